"""A ``DynamicCache`` whose layers append into spare capacity: appending costs the new tokens only.

Why: transformers' ``DynamicLayer.update`` concatenates, so every append copies the whole cache:
extending an assembled window by one chunk, prefilling a query over it and every decode step
each rewrite all of the window's KV, a copy that grows with the window on every step. A window
that reuses its assembled cache across asks, and a prefix cache that appends, need appends that
cost what they add. `BufferedLayer` keeps each layer's keys and
values in a buffer that grows by doubling and hands attention views of its filled part; `crop`
only moves the fill mark. What attention sees is identical (views of the same values).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kamera_agent.backends.transformers.windows import PositionedCache

__all__ = ["HEADROOM", "BufferedLayer", "buffered_cache"]

HEADROOM = 1024
"""Spare slots a reservation adds: a query and its answer then append without regrowing."""


class BufferedLayer(DynamicLayer):  # type: ignore[misc]
    """A ``DynamicLayer`` appending into a doubling buffer ``[B, H, capacity, D]`` per slot."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._filled = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._filled + int(key_states.shape[-2])
        if self._keys is None or end > self._keys.shape[-2]:
            self._grow(key_states, value_states, end)
        assert self._keys is not None and self._values is not None
        self._keys[..., self._filled : end, :] = key_states
        self._values[..., self._filled : end, :] = value_states
        self._filled = end
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or self._keys is None or self._values is None:
            return
        self._filled = max(0, self._filled + tokens_to_remove)
        self.keys = self._keys[..., : self._filled, :]
        self.values = self._values[..., : self._filled, :]

    def reserve(self, like_keys: torch.Tensor, like_values: torch.Tensor, slots: int) -> None:
        """Make room for ``slots`` tokens in all (one allocation before a batch of appends)."""
        if not self.is_initialized:
            self.lazy_initialization(like_keys, like_values)
        if self._keys is None or slots > self._keys.shape[-2]:
            self._grow(like_keys, like_values, slots)

    def reset(self) -> None:
        super().reset()
        self._keys = self._values = None
        self._filled = 0

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        capacity = max(needed, 2 * (0 if self._keys is None else int(self._keys.shape[-2])), 64)
        keys = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if self._keys is not None and self._values is not None and self._filled:
            keys[..., : self._filled, :] = self._keys[..., : self._filled, :]
            values[..., : self._filled, :] = self._values[..., : self._filled, :]
        self._keys, self._values = keys, values


def buffered_cache(config: Any, *, whole_history: bool = False) -> Any:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are `BufferedLayer` s (sliding
    window layers, which drop old tokens, are left as transformers makes them). With
    ``whole_history`` every layer keeps every slot, in a `PositionedCache` that records each
    slot's position: the backend then masks sliding layers by position itself (`windows`)."""
    cache = PositionedCache(config=config) if whole_history else DynamicCache(config=config)
    cache.layers = [
        BufferedLayer() if whole_history or type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache
