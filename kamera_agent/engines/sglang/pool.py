"""Chunk KV in and out of SGLang's token pools (MHA/GQA and MLA): the write ``init_load_back`` will do.

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
that order on the way in and back on the way out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from kamera_agent.errors import LayoutMismatchError
from kamera_agent.operator.layout import ChunkKV, KVLayout, at_positions, to_position_free
from kamera_agent.operator.rope import Pairing

__all__ = ["read_chunk", "rotary_pairing", "write_chunk"]


def rotary_pairing(rotary_emb: Any) -> Pairing:
    """How an SGLang rotary module pairs the band's features: ``"half"`` for NeoX style
    (``x[i]`` with ``x[i + F]``), ``"interleaved"`` for GPT-J style (``x[2i]`` with ``x[2i + 1]``)."""
    return "half" if rotary_emb.is_neox_style else "interleaved"


def write_chunk(
    pool: Any,
    kv: ChunkKV,
    layout: KVLayout,
    positions: torch.Tensor,
    slots: torch.Tensor,
    *,
    pool_pairing: Pairing | None = None,
) -> None:
    """Write position-free ``kv`` into ``pool`` at ``slots``, its rope band rotated to ``positions``
    (``[n]``, or ``[3, n]`` for M-RoPE: the positions SGLang computed for the request).

    ``pool_pairing``: how SGLang's rotary pairs the band (`rotary_pairing`); ``None`` means as
    ``layout`` does. Needed for DeepSeek-V3 with ``rope_interleave`` (its released checkpoints):
    ``"interleaved"`` there, while the transformers layout is ``"half"``.
    """
    _check_pool(pool, layout)
    placed = _reorder_band(at_positions(kv, layout, positions), layout, _band_order(layout, pool_pairing))
    loc = slots.to(device=pool.device, dtype=torch.int64)
    write = pool.set_mla_kv_buffer if layout.kind == "mla" else pool.set_kv_buffer
    for layer in range(layout.num_layers):
        keys, values = (_tokens_first(slot[layer], pool) for slot in (placed.keys, placed.values))
        write(None, loc, keys, values, layer_id_override=layer)  # MLA: (latent, k_pe)


def read_chunk(
    pool: Any,
    layout: KVLayout,
    slots: torch.Tensor,
    positions: torch.Tensor,
    chunk_key: str = "",
    *,
    pool_pairing: Pairing | None = None,
) -> ChunkKV:
    """The KV in ``pool`` at ``slots`` (written at ``positions``), position-free, in float32;
    ``pool_pairing`` as for `write_chunk`."""
    _check_pool(pool, layout)
    loc = slots.to(device=pool.device, dtype=torch.int64)
    layers = [_read_layer(pool, layout, layer, loc) for layer in range(layout.num_layers)]
    keys, values = (torch.stack([layer[i] for layer in layers]).float().cpu() for i in (0, 1))
    placed = ChunkKV(keys, values, positions.cpu(), chunk_key)
    order = _band_order(layout, pool_pairing)
    inverse = None if order is None else torch.argsort(order)
    return to_position_free(_reorder_band(placed, layout, inverse), layout)


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
