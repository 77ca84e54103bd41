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
`KVLayout` records this together with the model's `RotarySpec`, read from the model's own
rotary module so that every scaling variant is right by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from kamera_agent.errors import (
    LayoutMismatchError,
    LengthDependentRopeError,
    PositionShapeError,
    UnsupportedModelError,
)
from kamera_agent.operator.families import Family, family_of
from kamera_agent.operator.rope import RotarySpec, rotate, unrotate

__all__ = [
    "ChunkKV",
    "KVLayout",
    "at_positions",
    "check_layout",
    "kv_layout",
    "read_chunk",
    "rotary_spec",
    "to_position_free",
]

Slot = Literal["keys", "values"]
_LENGTH_DEPENDENT = ("dynamic", "longrope")


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
        family: the model family this layout was read for.
    """

    kind: Literal["mha", "gqa", "mla"]
    num_layers: int
    keys_shape: tuple[int, int]
    values_shape: tuple[int, int]
    rope_slot: Slot
    rope: RotarySpec
    family: Family

    def slot_shape(self, slot: Slot) -> tuple[int, int]:
        return self.keys_shape if slot == "keys" else self.values_shape

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


def rotary_spec(model: Any, family: Family | None = None) -> RotarySpec:
    """Read the rotary description from a loaded model's own language-model rotary module.

    Raises:
        LengthDependentRopeError: dynamic NTK or longrope, whose frequencies change with length.
        UnsupportedModelError: the family is unknown or no rotary module is found.
    """
    family = family or family_of(model.config)
    module = _language_rotary_module(model)
    rope_type = str(getattr(module, "rope_type", "default"))
    if any(tag in rope_type for tag in _LENGTH_DEPENDENT):
        raise LengthDependentRopeError(
            f"rope_type {rope_type!r} recomputes its frequencies from the sequence length, so a stored "
            "key has no fixed phase to relocate exactly. Use a static scaling (default, linear, llama3, "
            "yarn) for reuse, or serve this model by re-prefill."
        )
    buffer: torch.Tensor = getattr(module, "inv_freq")  # noqa: B009  (a buffer, not a method)
    inv_freq = buffer.detach().to("cpu", torch.float32).clone()  # [F]
    axes = _mrope_axes(family, getattr(module, "mrope_section", None), inv_freq.shape[0], module)
    return RotarySpec(
        inv_freq=inv_freq,
        pairing=family.pairing,
        axes=axes,
        rope_type=rope_type,
        attention_scaling=float(getattr(module, "attention_scaling", 1.0)),
    )


def kv_layout(model: Any) -> KVLayout:
    """Read a loaded transformers model's KV layout (MHA, GQA or MLA) and rotary spec."""
    family = family_of(model.config)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rope = rotary_spec(model, family)
    layers = int(text.num_hidden_layers)
    if family.attention == "mla":
        if rope.rotary_dim != int(text.qk_rope_head_dim):
            raise LayoutMismatchError(
                f"rotary module has {rope.rotary_dim} rotary features but qk_rope_head_dim is "
                f"{text.qk_rope_head_dim}; the config and the loaded rotary module disagree"
            )
        return KVLayout(
            kind="mla",
            num_layers=layers,
            keys_shape=(1, int(text.kv_lora_rank)),
            values_shape=(1, int(text.qk_rope_head_dim)),
            rope_slot="values",
            rope=rope,
            family=family,
        )
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    if rope.rotary_dim > head_dim:
        raise LayoutMismatchError(f"rotary band {rope.rotary_dim} exceeds head_dim {head_dim}")
    return KVLayout(
        kind="mha" if kv_heads == heads else "gqa",
        num_layers=layers,
        keys_shape=(kv_heads, head_dim),
        values_shape=(kv_heads, head_dim),
        rope_slot="keys",
        rope=rope,
        family=family,
    )


def read_chunk(
    cache: Any,
    layout: KVLayout,
    start: int,
    stop: int,
    positions: torch.Tensor,
    *,
    batch_index: int = 0,
    chunk_key: str = "",
    model_fingerprint: str = "",
) -> ChunkKV:
    """Copy cache slots ``[start, stop)`` of every layer into a `ChunkKV` placed at ``positions``.

    ``cache`` is a transformers ``Cache`` whose ``layers[i].keys/values`` are ``[B, H, S, D]``.
    """
    n = stop - start
    _check_count(positions, n)
    layers = cache.layers
    if len(layers) != layout.num_layers:
        raise LayoutMismatchError(f"cache has {len(layers)} layers, the layout {layout.num_layers}")
    keys = torch.stack([layer.keys[batch_index, :, start:stop] for layer in layers]).clone()
    values = torch.stack([layer.values[batch_index, :, start:stop] for layer in layers]).clone()
    kv = ChunkKV(keys, values, positions.clone(), chunk_key, model_fingerprint)
    check_layout(kv, layout)
    return kv


def check_layout(kv: ChunkKV, layout: KVLayout) -> None:
    """Raise `LayoutMismatchError` unless ``kv`` has this layout's per-token shapes."""
    for slot in ("keys", "values"):
        tensor = kv.slot(slot)  # type: ignore[arg-type]
        want = (layout.num_layers, *layout.slot_shape(slot))  # type: ignore[arg-type]
        got = (tensor.shape[0], tensor.shape[1], tensor.shape[3]) if tensor.ndim == 4 else tuple(tensor.shape)
        if got != want:
            raise LayoutMismatchError(
                f"{slot} slot has shape {tuple(tensor.shape)}, the {layout.family.name} layout needs "
                f"[{want[0]}, {want[1]}, n, {want[2]}]; was this KV made by another model?"
            )


def to_position_free(kv: ChunkKV, layout: KVLayout) -> ChunkKV:
    """Unrotate the rope band at the positions it was computed at: the stored, canonical form."""
    if kv.positions is None:
        return kv
    band = unrotate(kv.slot(layout.rope_slot), layout.rope, kv.positions)
    return _with_slot(kv, layout.rope_slot, band, positions=None)


def at_positions(kv: ChunkKV, layout: KVLayout, positions: torch.Tensor) -> ChunkKV:
    """Place a position-free chunk at ``positions`` (rotation only; values are untouched)."""
    if kv.positions is not None:
        raise PositionShapeError("at_positions needs position-free KV; call to_position_free first")
    _check_count(positions, kv.num_tokens)
    band = rotate(kv.slot(layout.rope_slot), layout.rope, positions)
    return _with_slot(kv, layout.rope_slot, band, positions=positions)


def _with_slot(kv: ChunkKV, slot: Slot, tensor: torch.Tensor, positions: torch.Tensor | None) -> ChunkKV:
    if slot == "keys":
        return replace(kv, keys=tensor, positions=positions)
    return replace(kv, values=tensor, positions=positions)


def _check_count(positions: torch.Tensor, n: int) -> None:
    if positions.shape[-1] != n or positions.ndim not in (1, 2):
        raise PositionShapeError(
            f"need positions [n] or [3, n] for {n} tokens, got shape {tuple(positions.shape)}"
        )


def _language_rotary_module(model: Any) -> torch.nn.Module:
    """The rotary module of the language model (never the vision tower's)."""
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if hasattr(module, "inv_freq") and "visual" not in name and "vision" not in name
    ]
    if not candidates:
        raise UnsupportedModelError(
            f"no rotary embedding module found in {type(model).__name__}; kamera-agent relocates RoPE "
            "models only"
        )
    # The shallowest one is the language model's shared rotary embedding.
    candidates.sort(key=lambda item: item[0].count("."))
    module: torch.nn.Module = candidates[0][1]
    return module


def _mrope_axes(
    family: Family, section: Any, num_freqs: int, module: torch.nn.Module | None = None
) -> torch.Tensor | None:
    """Position row (0 = t, 1 = h, 2 = w) of each frequency, from the model's ``mrope_section``.

    Where the rotary module exposes its own ``recomposition_frequencies`` we ask it directly
    (feed it rows tagged 0, 1, 2 and read back which row each frequency took), so the table
    is the model's by construction; the family's style is the fallback. For
    ``mrope_section = [2, 3, 3]`` (8 frequencies):

    ==========  ========================  ========================
    frequency   blocked (Qwen2/2.5-VL)    interleaved (Qwen3-VL)
    ==========  ========================  ========================
    0 1 2 3     t t h h                   t h w t
    4 5 6 7     h w w w                   h w t h
    ==========  ========================  ========================
    """
    if family.mrope is None:
        return None
    if section is None:
        raise UnsupportedModelError(f"{family.name} uses M-RoPE but its rotary module has no mrope_section")
    section = [int(s) for s in section]
    if sum(section) > num_freqs or len(section) != 3:
        raise LayoutMismatchError(f"mrope_section {section} must be 3 rows covering {num_freqs} frequencies")
    recompose = getattr(module, "recomposition_frequencies", None)
    if callable(recompose):
        tagged = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).repeat(1, 1, 1, num_freqs)
        recomposed: torch.Tensor = recompose(tagged)  # [1, 1, 2F]: cat((per_freq, per_freq))
        return recomposed[..., :num_freqs].reshape(num_freqs).round().long()
    if family.mrope == "blocked":
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    axes = torch.zeros(num_freqs, dtype=torch.int64)
    for row in (1, 2):
        idx = torch.arange(row, section[row] * 3, 3)
        axes[idx[idx < num_freqs]] = row  # the model's slice clips at F the same way
    return axes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
