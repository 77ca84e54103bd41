"""Chunk KV in and out of SGLang's token pools (MHA/GQA and MLA): `SGLangSlots`, the `KVSlots` of SGLang.

Why here: SGLang keeps a layer's KV per slot, kamera keeps a chunk position-free as
``[layers, heads, tokens, dim]``. Placing a stored chunk into a request is relocation (kamera's
operator: one rotation to SGLang's positions for this request, 1-D or M-RoPE) followed by a
write into newly allocated slots, on the pool's device and dtype; reading the slots back to
position-free KV is what capture needs. The two pools differ in what a slot holds:

- ``MHATokenToKVPool``: ``k_buffer`` / ``v_buffer`` ``[slots, heads, head_dim]``, written by
  ``set_kv_buffer``;
- ``MLATokenToKVPool``: one ``[slots, 1, kv_lora_rank + qk_rope_head_dim]`` row per layer, the
  latent c_KV then the rotated k_pe, written by ``set_mla_kv_buffer(latent, k_pe)``: kamera's
  MLA keys and values slots.

The pool must hold the rope band in the order SGLang's own rotary leaves it, which need not be
the order of the cache kamera read it from: SGLang rotates DeepSeek-V2/V3's k_pe GPT-J style in
place (``is_neox_style = not config.rope_interleave``, default ``True``: pairs ``(2i, 2i + 1)``),
whereas transformers' DeepSeek-V3 with ``rope_interleave`` (its released checkpoints)
de-interleaves the band while rotating and caches it half-split. ``pool_pairing`` (`rotary_pairing`
of the SGLang model's rotary module) says how the pool pairs the band; the band is permuted into
that order on the way in and back on the way out (after relocation, which `KVSlots` does).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from kamera_agent.engines.slots import KVSlots
from kamera_agent.errors import LayoutMismatchError
from kamera_agent.operator.layout import ChunkKV, KVLayout
from kamera_agent.operator.rope import Pairing

__all__ = ["SGLangSlots", "rotary_pairing"]


def rotary_pairing(rotary_emb: Any) -> Pairing:
    """How an SGLang rotary module pairs the band's features: ``"half"`` for NeoX style
    (``x[i]`` with ``x[i + F]``), ``"interleaved"`` for GPT-J style (``x[2i]`` with ``x[2i + 1]``)."""
    return "half" if rotary_emb.is_neox_style else "interleaved"


class SGLangSlots(KVSlots):
    """SGLang's MHA/GQA or MLA token pool as `KVSlots`.

    Args:
        pool: SGLang's ``MHATokenToKVPool`` or ``MLATokenToKVPool`` (every layer, every KV head).
        layout: the model's KV layout.
        pool_pairing: how SGLang's rotary pairs the rope band (`rotary_pairing`); ``None`` means
            as ``layout`` does. Needed for DeepSeek-V3 with ``rope_interleave`` (its released
            checkpoints): ``"interleaved"`` there, while the transformers layout is ``"half"``.

    Raises:
        LayoutMismatchError: a pool that does not hold every layer and head of ``layout``.
    """

    def __init__(self, pool: Any, layout: KVLayout, *, pool_pairing: Pairing | None = None) -> None:
        _check_pool(pool, layout)
        self.pool, self.layout = pool, layout
        self._order = _band_order(layout, pool_pairing)
        self._inverse = None if self._order is None else torch.argsort(self._order)

    def write_placed(self, kv: ChunkKV, slots: torch.Tensor) -> None:
        placed = _reorder_band(kv, self.layout, self._order)
        loc = slots.to(device=self.pool.device, dtype=torch.int64)
        write = self.pool.set_mla_kv_buffer if self.layout.kind == "mla" else self.pool.set_kv_buffer
        for layer in range(self.layout.num_layers):
            keys, values = (_tokens_first(slot[layer], self.pool) for slot in (placed.keys, placed.values))
            write(None, loc, keys, values, layer_id_override=layer)  # MLA: (latent, k_pe)

    def read_placed(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loc = slots.to(device=self.pool.device, dtype=torch.int64)
        layers = [_read_layer(self.pool, self.layout, layer, loc) for layer in range(self.layout.num_layers)]
        keys, values = (torch.stack([layer[i] for layer in layers]).float().cpu() for i in (0, 1))
        placed = _reorder_band(ChunkKV(keys, values), self.layout, self._inverse)
        return placed.keys, placed.values


def _read_layer(
    pool: Any, layout: KVLayout, layer: int, loc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values slots at ``loc``, ``[heads, n, dim]`` each."""
    if layout.kind == "mla":
        row = pool.get_key_buffer(layer)[loc]  # [n, 1, kv_lora_rank + qk_rope_head_dim]
        rank, rope = layout.keys_shape[1], layout.values_shape[1]
        return row[..., :rank].transpose(0, 1), row[..., rank : rank + rope].transpose(0, 1)
    return pool.get_key_buffer(layer)[loc].transpose(0, 1), pool.get_value_buffer(layer)[loc].transpose(0, 1)


def _tokens_first(slot: torch.Tensor, pool: Any) -> torch.Tensor:
    """``[heads, n, dim]`` as the pool takes it: ``[n, heads, dim]`` on its device and dtype."""
    return slot.transpose(0, 1).to(device=pool.device, dtype=pool.dtype).contiguous()


def _band_order(layout: KVLayout, pool_pairing: Pairing | None) -> torch.Tensor | None:
    """Feature order of the pool's band (pool band = kamera band ``[..., order]``), ``None`` if same."""
    if pool_pairing not in (None, "half", "interleaved"):
        raise LayoutMismatchError(f"pool_pairing must be 'half' or 'interleaved', got {pool_pairing!r}")
    if pool_pairing is None or pool_pairing == layout.rope.pairing:
        return None
    freqs = layout.rope.num_freqs
    if pool_pairing == "interleaved":  # pair (i, i + F) goes to (2i, 2i + 1)
        return torch.stack([torch.arange(freqs), torch.arange(freqs, 2 * freqs)], dim=-1).flatten()
    return torch.cat([torch.arange(0, 2 * freqs, 2), torch.arange(1, 2 * freqs, 2)])  # the inverse


def _reorder_band(kv: ChunkKV, layout: KVLayout, order: torch.Tensor | None) -> ChunkKV:
    """``kv`` with its rope band's leading features taken in ``order`` (the rest pass through)."""
    if order is None:
        return kv
    slot = kv.slot(layout.rope_slot)
    band = torch.cat([slot[..., order.to(slot.device)], slot[..., order.numel() :]], dim=-1)
    return replace(kv, keys=band) if layout.rope_slot == "keys" else replace(kv, values=band)


def _check_pool(pool: Any, layout: KVLayout) -> None:
    """Raise `LayoutMismatchError` unless ``pool`` holds every layer of ``layout``, slot shapes alike."""
    if layout.kind == "mla":
        want: tuple[int, ...] = (layout.keys_shape[1], layout.values_shape[1])
        got = tuple(getattr(pool, name, None) for name in ("kv_lora_rank", "qk_rope_head_dim"))
        what = "(kv_lora_rank, qk_rope_head_dim)"
    else:
        want = (*layout.keys_shape, layout.values_shape[1])
        got = tuple(getattr(pool, name, None) for name in ("head_num", "head_dim", "v_head_dim"))
        what = "(kv heads, head_dim, v_head_dim)"
    if got != want:
        raise LayoutMismatchError(
            f"{type(pool).__name__} holds {what} = {got}, the {layout.name} {layout.kind.upper()} layout "
            f"needs {want}: an MLA layout needs SGLang's MLATokenToKVPool, MHA/GQA its MHATokenToKVPool, "
            "with every KV head on this rank (no tensor-parallel shard)"
        )
    start, count = int(getattr(pool, "start_layer", 0) or 0), int(pool.layer_num)
    if (start, count) != (0, layout.num_layers):
        raise LayoutMismatchError(
            f"{type(pool).__name__} holds layers {start}..{start + count - 1}, "
            f"the {layout.name} layout has {layout.num_layers}: a pipeline-parallel pool holds a slice"
        )
