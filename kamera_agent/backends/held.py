"""The bytes an engine object holds in tensors: what releasing it gives back.

Why by storage: an assembled cache hands attention views of larger buffers (spare capacity for
appends), and keys, values and their views share storages; counting each storage once, whole,
is what the allocator holds for it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["held_bytes"]

_DEPTH = 4
"""How far into attributes and containers tensors are looked for (a cache's layers' buffers)."""


def held_bytes(obj: Any) -> int:
    """Bytes of every tensor storage ``obj`` reaches through its attributes, lists, tuples and
    dicts (up to a few levels down), each storage counted once."""
    storages: dict[tuple[str, int], int] = {}
    _collect(obj, storages, _DEPTH, set())
    return sum(storages.values())


def _collect(obj: Any, storages: dict[tuple[str, int], int], depth: int, seen: set[int]) -> None:
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
        return
    if depth == 0 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, torch.nn.Module):
        return  # a model's weights are not a cache's
    else:
        items = getattr(obj, "__dict__", {}).values()
    for item in list(items):
        _collect(item, storages, depth - 1, seen)
