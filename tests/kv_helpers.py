"""Ground truth from the model's own forward, shared by the operator tests."""

from __future__ import annotations

from typing import Any

import torch

from kamera_agent.backends.transformers import read_chunk
from kamera_agent.backends.transformers.cache import buffered_cache
from kamera_agent.backends.transformers.windows import sliding_layers
from kamera_agent.compat import cache_kwarg, output_cache
from kamera_agent.divergence import next_token_kl, relative_error
from kamera_agent.operator import ChunkKV, KVLayout

rel_err = relative_error
__all__ = ["cache_from", "chunk_kv", "extend", "next_token_kl", "prefill", "rel_err"]


def prefill(model: Any, positions: torch.Tensor, **inputs: Any) -> tuple[Any, torch.Tensor]:
    """One forward with explicit positions (``[n]`` or ``[3, n]``); returns (cache, logits ``[n, V]``)."""
    pos = positions[None] if positions.ndim == 1 else positions[:, None]  # [1, n] or [3, 1, n]
    with torch.no_grad():
        out = model(position_ids=pos, use_cache=True, **_whole(model), **inputs)
    return output_cache(out), out.logits[0]


def _whole(model: Any) -> dict[str, Any]:
    """For a model with sliding-window layers, a cache keeping every slot (transformers' own
    sliding layers drop the oldest, so chunks could not be read back out); the model still masks
    its windows itself, by slot, which in one forward from an empty cache is by position."""
    if sliding_layers(model.config) is None:
        return {}
    return {cache_kwarg(model): buffered_cache(model.config, whole_history=True)}


def extend(model: Any, cache: Any, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Feed ``ids`` ``[n]`` after ``cache`` (mutated) at ``positions``; returns logits ``[n, V]``."""
    pos = positions[None] if positions.ndim == 1 else positions[:, None]
    with torch.no_grad():
        out = model(input_ids=ids[None], position_ids=pos, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits[0]


def chunk_kv(model: Any, layout: KVLayout, positions: torch.Tensor, start: int = 0, **inputs: Any) -> ChunkKV:
    """The model's own KV for tokens ``[start, n)`` of ``inputs`` prefilled at ``positions``."""
    cache, _ = prefill(model, positions, **inputs)
    n = positions.shape[-1]
    return read_chunk(cache, layout, start, n, positions[..., start:])


def cache_from(model: Any, chunks: list[ChunkKV]) -> Any:
    """A transformers ``DynamicCache`` holding ``chunks`` back to back (batch 1)."""
    from transformers import DynamicCache

    cache = _whole(model).popitem()[1] if sliding_layers(model.config) else DynamicCache(config=model.config)
    keys = torch.cat([c.keys for c in chunks], dim=2)  # [L, H, S, D]
    values = torch.cat([c.values for c in chunks], dim=2)
    for layer in range(keys.shape[0]):
        cache.update(keys[layer][None], values[layer][None], layer)
    return cache
