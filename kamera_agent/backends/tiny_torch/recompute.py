"""The tiny model's caches for selective recompute and for a partial forward.

Why caches and not model changes: `TinyRopeLM` hands each layer's new keys and values to its
cache and attends to what the cache returns, so what a forward attends to and how far it runs
are the cache's to decide. `ScatterCache` writes the selected tokens' fresh rows into their own
slots of the placed chunk (the rest is reused); `HaltingCache` keeps one layer's fresh rows and
stops the forward there, so a probe pays only the layers before it.
"""

from __future__ import annotations

import torch

from kamera_agent.backends.tiny_torch.model import TinyKVCache

__all__ = ["Halted", "HaltingCache", "ScatterCache"]


class ScatterCache(TinyKVCache):
    """Per-layer ``[kv_heads, S, head_dim]`` KV of the context and the whole chunk; an append
    writes the selected tokens' rows into ``slots`` ``[m]`` and returns the whole layer."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor) -> None:
        super().__init__(keys, values)
        self.slots = slots

    def append(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer][:, self.slots] = keys
        self.values[layer][:, self.slots] = values
        return self.keys[layer], self.values[layer]


class Halted(Exception):
    """Raised by `HaltingCache` once it holds the layer it waited for: the forward stops there."""


class HaltingCache(TinyKVCache):
    """A cache that appends as usual below layer ``depth`` and, at ``depth``, keeps the new rows
    in ``fresh`` (``[kv_heads, n, head_dim]`` keys and values) and raises `Halted`."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], depth: int) -> None:
        super().__init__(keys, values)
        self.depth = depth
        self.fresh: tuple[torch.Tensor, torch.Tensor] | None = None

    def append(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == self.depth:
            self.fresh = (keys, values)
            raise Halted
        return super().append(layer, keys, values)
