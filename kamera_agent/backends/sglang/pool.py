"""Chunk KV in and out of SGLang's MHA/GQA token pool: the write ``init_load_back`` will do.

Why here: SGLang keeps each layer's keys and values as ``[slots, heads, head_dim]`` buffers
(``MHATokenToKVPool.k_buffer`` / ``v_buffer``) written through ``set_kv_buffer``; kamera keeps a
chunk position-free as ``[layers, heads, tokens, dim]``. Placing a stored chunk into a request is
relocation (kamera's operator: one rotation to SGLang's positions for this request, 1-D or
M-RoPE) followed by a write into newly allocated slots, on the pool's device and dtype. The
reverse read is what capture needs: the pool's slots back to position-free KV.
"""

from __future__ import annotations

from typing import Any

import torch

from kamera_agent.operator.layout import ChunkKV, KVLayout, at_positions, to_position_free

__all__ = ["read_chunk", "write_chunk"]


def write_chunk(
    pool: Any, kv: ChunkKV, layout: KVLayout, positions: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write position-free ``kv`` into ``pool`` at ``slots``, its keys rotated to ``positions``
    (``[n]``, or ``[3, n]`` for M-RoPE: the positions SGLang computed for the request)."""
    placed = at_positions(kv, layout, positions)
    loc = slots.to(device=pool.device, dtype=torch.int64)
    for layer in range(placed.keys.shape[0]):
        keys = placed.keys[layer].transpose(0, 1).to(device=pool.device, dtype=pool.dtype)
        values = placed.values[layer].transpose(0, 1).to(device=pool.device, dtype=pool.dtype)
        pool.set_kv_buffer(None, loc, keys.contiguous(), values.contiguous(), layer_id_override=layer)


def read_chunk(
    pool: Any, layout: KVLayout, slots: torch.Tensor, positions: torch.Tensor, chunk_key: str = ""
) -> ChunkKV:
    """The KV in ``pool`` at ``slots`` (written at ``positions``), position-free, in float32."""
    loc = slots.to(device=pool.device, dtype=torch.int64)
    keys = torch.stack([pool.get_key_buffer(i)[loc].transpose(0, 1) for i in range(pool.layer_num)])
    values = torch.stack([pool.get_value_buffer(i)[loc].transpose(0, 1) for i in range(pool.layer_num)])
    placed = ChunkKV(keys.float().cpu(), values.float().cpu(), positions.cpu(), chunk_key)
    return to_position_free(placed, layout)
