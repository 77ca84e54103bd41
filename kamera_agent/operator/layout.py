"""KV layouts: what a model's cache holds per token, and which part of it carries position.

Why: MHA, GQA and MLA look different in the cache but reduce to one pipeline once each is
read as a *content* part (position-free, stored and patched as is) and a *rope band* (rotated
to place the chunk). As the transformers cache holds them, per layer and token:

=====  ===========================================  ===========================================
kind   ``keys`` slot                                ``values`` slot
=====  ===========================================  ===========================================
MHA    ``[heads, head_dim]`` keys, band rotated     ``[heads, v_dim]`` values, never rotated
GQA    ``[kv_heads, head_dim]`` keys, band rotated  ``[kv_heads, v_dim]`` values
MLA    ``[1, kv_lora_rank]`` normalised latent c_KV ``[1, qk_rope_head_dim]`` k_pe, all rotated
=====  ===========================================  ===========================================

With partial rotary only the leading ``rotary_dim`` features of a key are rotated.
`KVLayout` records this together with the model's `RotarySpec`. Both are handed in by a
backend (the transformers backend reads them from the model's own rotary module, so every
scaling variant is right by construction): the operator knows no engine and no model family.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kamera_agent.errors import LayoutMismatchError, PositionShapeError
from kamera_agent.operator.rope import RotarySpec, rotate, unrotate

Slot = Literal["keys", "values"]
"""A KV cache slot: MHA/GQA keep keys and values there; MLA its latent (keys) and k_pe (values)."""

__all__ = [
    "ChunkKV",
    "KVLayout",
    "Slot",
    "at_positions",
    "check_layout",
    "check_positions",
    "relocate",
    "to_position_free",
    "to_position_free_many",
]


@dataclass(frozen=True, eq=False)
class KVLayout:
    """Per-token shape of a model's cache and where its rotary band sits.

    Attributes:
        kind: ``"mha"``, ``"gqa"`` or ``"mla"``.
        num_layers: decoder layers, each with one cache entry.
        keys_shape: ``(heads, dim)`` of the cache's keys slot per token.
        values_shape: ``(heads, dim)`` of the cache's values slot per token.
        rope_slot: the slot whose leading ``rope.rotary_dim`` features carry the phase.
        rope: the model's rotary description.
        name: the model family or engine model this layout describes (for messages).
    """

    kind: Literal["mha", "gqa", "mla"]
    num_layers: int
    keys_shape: tuple[int, int]
    values_shape: tuple[int, int]
    rope_slot: Slot
    rope: RotarySpec
    name: str = "model"

    def slot_shape(self, slot: Slot) -> tuple[int, int]:
        return self.keys_shape if slot == "keys" else self.values_shape

    @property
    def features(self) -> int:
        """Features of the widest slot (heads · dim): no patch of a chunk has a higher rank."""
        return max(self.keys_shape[0] * self.keys_shape[1], self.values_shape[0] * self.values_shape[1])

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes one token takes over all layers, both slots."""
        per_layer = self.keys_shape[0] * self.keys_shape[1] + self.values_shape[0] * self.values_shape[1]
        return self.num_layers * per_layer * _itemsize(dtype)


@dataclass(frozen=True, eq=False)
class ChunkKV:
    """One chunk's cache entries over all layers, in the cache's own two slots.

    Attributes:
        keys: ``[L, Hk, n, Dk]``, the keys slot (MLA: the latent c_KV).
        values: ``[L, Hv, n, Dv]``, the values slot (MLA: k_pe).
        positions: where the rope band is rotated to, ``[n]`` or ``[3, n]``; ``None`` means
            position-free (the band is unrotated): the form a canonical is stored in.
        chunk_key: content key of the chunk this KV belongs to ("" when unknown).
        model_fingerprint: fingerprint of the model that computed it ("" when unknown).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor | None = None
    chunk_key: str = ""
    model_fingerprint: str = ""

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[-2])

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors (positions not counted: a few bytes per token)."""
        return _nbytes(self.keys) + _nbytes(self.values)

    def slot(self, slot: Slot) -> torch.Tensor:
        return self.keys if slot == "keys" else self.values


def check_layout(kv: ChunkKV, layout: KVLayout) -> None:
    """Raise `LayoutMismatchError` unless ``kv`` has this layout's per-token shapes."""
    for slot in ("keys", "values"):
        tensor = kv.slot(slot)  # type: ignore[arg-type]
        want = (layout.num_layers, *layout.slot_shape(slot))  # type: ignore[arg-type]
        got = (tensor.shape[0], tensor.shape[1], tensor.shape[3]) if tensor.ndim == 4 else tuple(tensor.shape)
        if got != want:
            raise LayoutMismatchError(
                f"{slot} slot has shape {tuple(tensor.shape)}, the {layout.name} layout needs "
                f"[{want[0]}, {want[1]}, n, {want[2]}]; was this KV made by another model?"
            )


def to_position_free(kv: ChunkKV, layout: KVLayout) -> ChunkKV:
    """Unrotate the rope band at the positions it was computed at: the stored, canonical form."""
    if kv.positions is None:
        return kv
    band = unrotate(kv.slot(layout.rope_slot), layout.rope, kv.positions)
    return _with_slot(kv, layout.rope_slot, band, positions=None)


def to_position_free_many(kvs: Sequence[ChunkKV], layout: KVLayout) -> list[ChunkKV]:
    """`to_position_free` of each chunk, as one rotation over all their tokens.

    Why: one forward conditions a whole run of small chunks, and on a GPU a small chunk's
    rotation costs its dozen kernel launches, not its arithmetic. Every rotation is per token,
    so each result is the same bit for bit, and owns its own contiguous tensor: storing or
    dropping one chunk never keeps the others' bytes alive. Chunks whose bands differ in shape, dtype or
    device, or in how their positions are given, are each unrotated on their own."""
    placed = [(kv, kv.positions) for kv in kvs if kv.positions is not None]
    slot = layout.rope_slot
    bands = [kv.slot(slot) for kv, _ in placed]
    alike = {
        (b.shape[:-2], b.shape[-1], b.dtype, b.device, p.ndim, p.device)
        for b, (_, p) in zip(bands, placed, strict=True)
    }
    if len(placed) < 2 or len(alike) != 1:
        return [to_position_free(kv, layout) for kv in kvs]
    positions = torch.cat([p for _, p in placed], dim=-1)
    band = unrotate(torch.cat(bands, dim=-2), layout.rope, positions)
    pieces = iter(band.split([kv.num_tokens for kv, _ in placed], dim=-2))
    return [
        kv if kv.positions is None else _with_slot(kv, slot, next(pieces).contiguous(), positions=None)
        for kv in kvs
    ]


def relocate(kv: ChunkKV, layout: KVLayout, positions: torch.Tensor) -> ChunkKV:
    """Place a position-free chunk at ``positions``: its keys' rope band rotated by the model's
    own rotary for those positions (values untouched). Exact for every position-linear scheme.

    Raises:
        PositionShapeError: ``kv`` still carries positions (un-rotate it with `to_position_free`),
            or ``positions`` do not fit its tokens.
    """
    if kv.positions is not None:
        raise PositionShapeError("relocate needs position-free KV; call to_position_free first")
    check_positions(positions, kv.num_tokens)
    band = rotate(kv.slot(layout.rope_slot), layout.rope, positions)
    return _with_slot(kv, layout.rope_slot, band, positions=positions)


def at_positions(kv: ChunkKV, layout: KVLayout, positions: torch.Tensor) -> ChunkKV:
    """Deprecated name of `relocate` (the one word for placing a chunk's KV at positions)."""
    warnings.warn("at_positions is now relocate(kv, layout, positions)", DeprecationWarning, stacklevel=2)
    return relocate(kv, layout, positions)


def _with_slot(kv: ChunkKV, slot: Slot, tensor: torch.Tensor, positions: torch.Tensor | None) -> ChunkKV:
    # the constructor, not dataclasses.replace: this runs once per chunk stored or placed, and
    # replace re-reads the fields each call (a few microseconds per chunk of an op's bookkeeping)
    keys, values = (tensor, kv.values) if slot == "keys" else (kv.keys, tensor)
    return ChunkKV(keys, values, positions, kv.chunk_key, kv.model_fingerprint)


def check_positions(positions: torch.Tensor, n: int) -> None:
    """Raise `PositionShapeError` unless ``positions`` is ``[n]`` or ``[3, n]``."""
    if positions.shape[-1] != n or positions.ndim not in (1, 2):
        raise PositionShapeError(
            f"need positions [n] or [3, n] for {n} tokens, got shape {tuple(positions.shape)}"
        )


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize  # no tensor allocated (planning asks this several times an op)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
