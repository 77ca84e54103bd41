"""Sliding-window attention by position: masks for models whose layers see a window of keys.

Why our own masks: transformers sizes a layer's window by cache slots, and its sliding cache
layers drop the oldest slots. kamera's caches hold every layer's whole history (a chunk's KV is
read back out of every layer, and chunks are stored for reuse), and a run of chunks may sit at
positions other than its slots (a formation appended after placed chunks it must not see). So
for such models the backend masks each layer type itself, by the positions the keys were
rotated to: a query at position ``q`` sees a key at ``k`` in a sliding layer only when
``q - k < window`` (transformers' own rule), and in every layer only the slots it may see.

Relocation stays exact in both kinds of layer: each rotates by its own base (`RotarySpec` per
layer) and the window is relative, so a chunk run behind the same chunks computes the same KV
at any offset. What a window cannot see it cannot absorb: a chunk's conditioning in a sliding
layer comes from the last ``window`` positions only, and the state a chunk's KV is filed under
names its whole chain of antecedents, so a stored state is served only behind that same chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kamera_agent.errors import UnsupportedModelError

__all__ = ["PositionedCache", "SlidingLayers", "sliding_layers"]

_SLIDING, _FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class SlidingLayers:
    """Which layers attend within a window, and how the decoder takes its masks.

    Attributes:
        window: a sliding layer's query at ``q`` sees keys at positions ``> q - window``.
        keyed: the decoder takes one mask per layer type (``{"full_attention": …,
            "sliding_attention": …}``); otherwise every layer slides and takes one mask.
    """

    window: int
    keyed: bool

    def masks(
        self, queries: torch.Tensor, keys: torch.Tensor, blocked: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive 4-D masks ``[1, 1, n, S]`` for queries at ``queries`` ``[n]`` over cache
        slots whose keys sit at ``keys`` ``[S]``, with ``blocked`` ``[n, S]`` (bool) hidden in
        every layer (the future, and what a gapped run must not see)."""
        far = (queries[:, None] - keys[None, :]) >= self.window  # [n, S]
        sliding = _additive(blocked | far, dtype)
        if not self.keyed:
            return sliding
        return {_FULL: _additive(blocked, dtype), _SLIDING: sliding}


def sliding_layers(config: Any) -> SlidingLayers | None:
    """The sliding layers of ``config``'s decoder, or ``None`` where every layer sees all keys.

    Raises:
        UnsupportedModelError: chunked attention, or sliding windows of several sizes.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds, kwargs = get_layer_types_and_kwargs(text)
    unknown = sorted(set(kinds) - {_SLIDING, _FULL})
    if unknown:
        raise UnsupportedModelError(
            f"layer types {unknown} are not supported: kamera masks full and sliding-window attention only"
        )
    windows = {int(kw["sliding_window"]) for kind, kw in zip(kinds, kwargs, strict=True) if kind == _SLIDING}
    if not windows:
        return None
    if len(windows) > 1:
        raise UnsupportedModelError(f"sliding windows of several sizes ({sorted(windows)}) are not supported")
    return SlidingLayers(window=windows.pop(), keyed=getattr(text, "layer_types", None) is not None)


class PositionedCache(DynamicCache):  # type: ignore[misc]
    """A ``DynamicCache`` that knows the position each slot's keys were rotated to
    (``positions`` ``[S]``), kept by the backend as it fills and crops the cache."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.positions = torch.empty(0, dtype=torch.long)

    def record(self, positions: torch.Tensor) -> None:
        """Slots just appended sit at ``positions`` ``[n]``."""
        self.positions = torch.cat([self.positions, positions.to("cpu", torch.long)])

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        self.positions = self.positions[: self.get_seq_length()]


def _additive(blocked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(1, 1, *blocked.shape, dtype=dtype, device=blocked.device)
    return mask.masked_fill_(blocked[None, None], torch.finfo(dtype).min)
