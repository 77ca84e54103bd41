"""Selective recompute through a transformers model: cache layers that decide what attention sees.

Why cache layers: every supported attention (MHA/GQA, M-RoPE, MLA's latent and k_pe) hands its
new keys and values to ``cache.update`` and attends to what it returns, so the model's own
forward runs unchanged. `ScatterLayer` holds the context and the placed chunk and writes the
selected tokens' fresh rows into their own slots (the rest of the chunk is reused);
`HaltingLayer` keeps one layer's fresh rows and stops the forward there, so a deviation probe pays
only the layers before it. Masks and vision rows come from `kamera_agent.backends.recompute`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kamera_agent.backends.base import Deviation, Prefilled, Spent
from kamera_agent.backends.recompute import (
    deviation_scores,
    deviation_spent,
    recompute_hidden,
    replace_rows,
    vision_rows,
)
from kamera_agent.backends.runs import PlacedChunk
from kamera_agent.errors import CapabilityError
from kamera_agent.operator.layout import ChunkKV

if TYPE_CHECKING:
    from kamera_agent.backends.transformers.backend import TransformersBackend

__all__ = ["Halted", "HaltingLayer", "ScatterLayer", "check_supported", "deviation", "recompute"]


class ScatterLayer(DynamicLayer):  # type: ignore[misc]
    """Placed KV ``[1, H, S, D]`` (context, then the chunk) whose rows ``slots`` ``[m]`` this
    forward recomputes: it counts the other ``S - m`` as cached, and an update writes the fresh
    rows into their slots and returns the whole layer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.whole: tuple[torch.Tensor, torch.Tensor] = (keys, values)
        self.slots = slots.to(keys.device)
        self._cached = int(keys.shape[-2]) - int(slots.numel())

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.whole
        keys[..., self.slots, :] = key_states
        values[..., self.slots, :] = value_states
        self._cached = int(keys.shape[-2])
        return keys, values

    def get_seq_length(self) -> int:
        return self._cached

    def fresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The recomputed rows, ``[H, m, D]`` keys and values."""
        keys, values = self.whole
        return keys[0][:, self.slots], values[0][:, self.slots]


class Halted(Exception):
    """Raised by `HaltingLayer` once it holds its layer's fresh rows: the forward stops there."""


class HaltingLayer(DynamicLayer):  # type: ignore[misc]
    """Keeps the new keys and values it is handed (``fresh``, ``[1, H, n, D]`` each) and raises
    `Halted`: the layers after it never run."""

    def __init__(self) -> None:
        super().__init__()
        self.fresh: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.fresh = (key_states, value_states)
        raise Halted


def recompute(backend: TransformersBackend, placed: PlacedChunk, indices: torch.Tensor) -> Prefilled:
    """`Backend.recompute_run` on a transformers model: one forward of the selected tokens over a
    cache of `ScatterLayer` s, masked so each sees the context and the chunk slots up to its own."""
    chunk, n = placed.chunk, placed.chunk.num_tokens
    rows = [*placed.context, placed.kv]
    cached = placed.cached
    slots = cached + indices
    layers = [_scatter(rows, layer, slots, backend) for layer in range(backend.layout.num_layers)]
    cache = DynamicCache(config=backend.model.config)
    cache.layers = list(layers)
    mm = chunk.mm_token_type_ids[indices]
    selected = vision_rows(placed.vision, chunk.mm_token_type_ids, indices)
    positions = chunk.positions_at(placed.start)[..., indices]
    hidden = recompute_hidden(cached, n, indices)
    keys_at = _slot_positions(rows) if backend.sliding is not None else None
    backend.forward(
        chunk.input_ids[indices], mm, positions, cache, selected, logits=False, hidden=hidden, keys_at=keys_at
    )
    keys, values = (torch.stack(fresh) for fresh in zip(*(layer.fresh() for layer in layers), strict=True))
    return Prefilled(
        (replace_rows(placed.kv, indices, keys, values),), Spent(forwards=1, tokens_prefilled=len(indices))
    )


def deviation(backend: TransformersBackend, placed: PlacedChunk, layers: int) -> Deviation:
    """`Backend.deviation_run` on a transformers model: the chunk's tokens over the context until
    layer ``layers`` hands its fresh KV to a `HaltingLayer`."""
    chunk = placed.chunk
    cache = backend.assemble(placed.context)
    probe = cache.layers[layers] = HaltingLayer()
    with contextlib.suppress(Halted):  # the probe stops the forward at layer ``layers``
        backend.forward(
            chunk.input_ids,
            chunk.mm_token_type_ids,
            chunk.positions_at(placed.start),
            cache,
            placed.vision,
            logits=False,
        )
    assert probe.fresh is not None, "the partial forward never reached the probed layer"
    keys, values = probe.fresh
    scores = deviation_scores(keys[0], values[0], placed.kv, layers)
    return Deviation(scores, layers, deviation_spent(chunk.num_tokens, layers, backend.layout.num_layers))


def _slot_positions(placed: Sequence[ChunkKV]) -> torch.Tensor:
    """``[S]``: where each slot of ``placed`` (context, then the chunk) sits."""
    positions = [kv.positions for kv in placed]
    if any(where is None for where in positions):
        raise ValueError("recompute needs placed KV (positions set) for a sliding-window model")
    return torch.cat([where for where in positions if where is not None], dim=-1)


def check_supported(backend: TransformersBackend) -> None:
    """Refuse selective recompute on attention it cannot mask, saying which attention to load."""
    if not backend.supports_recompute:
        raise CapabilityError(
            f"{type(backend.model).__name__} runs {backend.model.config._attn_implementation!r} attention, "
            "which selective recompute cannot mask; load it with attn_implementation='sdpa' or 'eager', "
            "or re-prefill the chunk"
        )


def _scatter(
    placed: Sequence[ChunkKV], layer: int, slots: torch.Tensor, backend: TransformersBackend
) -> ScatterLayer:
    """Layer ``layer`` of ``placed`` back to back, ``[1, H, S, D]`` on the engine, as a `ScatterLayer`."""
    device, dtype = backend.device, backend.dtype
    keys = torch.cat([kv.keys[layer] for kv in placed], dim=1)[None].to(device, dtype)
    values = torch.cat([kv.values[layer] for kv in placed], dim=1)[None].to(device, dtype)
    return ScatterLayer(keys, values, slots)  # torch.cat copies: the placed KV is never written
