"""Tokens' KV in and out of vLLM's paged cache tensors, one layer at a time.

Why a module of its own: a vLLM attention backend decides how a block lays its tokens out, and
the connector must write exactly that layout (a load) and read it back (a capture). Two are
handled:

- **CPU_ATTN** (vLLM's CPU build): a layer is ``[blocks, kv_heads, block_size, 2 · head]``; each
  ``(block, head)`` slab holds the block's keys, then its values, written by vLLM's own
  ``cpu_attn_reshape_and_cache`` for the ISA it picks. With the ``vec``/``vec16`` ISAs (fp32,
  and wherever AMX is absent) keys are stored transposed (``[head, block_size]``) and values
  row-major; writes go through vLLM's op, reads undo that layout. The AMX layout (bf16 on CPUs
  with AMX) is written by the op too but not read back here (`BlockLayoutError`).
- **Flash layout** (vLLM's GPU backends): ``[2, blocks, block_size, kv_heads, head]``, addressed
  directly (not verified here: no GPU was lent).

Slots are vLLM's: ``block_id * block_size + offset``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kamera_agent.engines.slots import KVSlots
from kamera_agent.engines.versions import SUPPORTED
from kamera_agent.errors import KameraError
from kamera_agent.operator.layout import ChunkKV, KVLayout

__all__ = ["BlockLayoutError", "VLLMSlots", "read_tokens", "write_tokens"]


class BlockLayoutError(KameraError):
    """vLLM's KV cache is laid out in a way this connector cannot read or write."""


class VLLMSlots(KVSlots):
    """vLLM's per-layer paged caches (ordered by layer index) as `KVSlots`."""

    def __init__(self, caches: Sequence[torch.Tensor], layout: KVLayout) -> None:
        self.caches, self.layout = list(caches), layout

    def write_placed(self, kv: ChunkKV, slots: torch.Tensor) -> None:
        for layer, cache in enumerate(self.caches):
            write_tokens(cache, kv.keys[layer].transpose(0, 1), kv.values[layer].transpose(0, 1), slots)

    def read_placed(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [read_tokens(cache, slots) for cache in self.caches]
        keys = torch.stack([k.transpose(0, 1) for k, _ in pairs]).float().cpu()
        values = torch.stack([v.transpose(0, 1) for _, v in pairs]).float().cpu()
        return keys, values


def write_tokens(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``keys`` / ``values`` ``[tokens, kv_heads, head]`` at ``slots`` of one layer's cache."""
    slots = slots.to(device=cache.device, dtype=torch.long)
    keys, values = keys.to(cache.device, cache.dtype), values.to(cache.device, cache.dtype)
    if _is_flash(cache):
        blocks, offsets = slots // cache.shape[2], slots % cache.shape[2]
        cache[0, blocks, offsets] = keys
        cache[1, blocks, offsets] = values
        return
    from vllm._custom_ops import cpu_attn_reshape_and_cache

    key_cache, value_cache, block_size, head = _cpu_views(cache)
    isa = _cpu_isa(cache.dtype, block_size, head)
    cpu_attn_reshape_and_cache(keys.contiguous(), values.contiguous(), key_cache, value_cache, slots, isa)


def read_tokens(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``[tokens, kv_heads, head]`` at ``slots`` of one layer's cache."""
    slots = slots.to(device=cache.device, dtype=torch.long)
    if _is_flash(cache):
        blocks, offsets = slots // cache.shape[2], slots % cache.shape[2]
        return cache[0, blocks, offsets], cache[1, blocks, offsets]
    num_blocks, heads, block_size, fused = cache.shape
    head = fused // 2
    isa = _cpu_isa(cache.dtype, block_size, head)
    if isa not in ("vec", "vec16"):
        raise BlockLayoutError(
            f"vLLM's CPU attention packs this cache for the {isa!r} ISA, which kamera cannot read back; "
            "serve in float32 or on a CPU without AMX, or turn capture off"
        )
    slabs = cache.view(num_blocks, heads, 2 * block_size * head)
    blocks, offsets = slots // block_size, slots % block_size
    keys = slabs[:, :, : block_size * head].view(num_blocks, heads, head, block_size)
    values = slabs[:, :, block_size * head :].view(num_blocks, heads, block_size, head)
    return keys[blocks, :, :, offsets], values[blocks, :, offsets, :]


def _is_flash(cache: torch.Tensor) -> bool:
    return cache.ndim == 5 and cache.shape[0] == 2


def _cpu_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    if cache.ndim != 4 or cache.shape[-1] % 2:
        raise BlockLayoutError(
            f"a KV cache layer of shape {tuple(cache.shape)} is neither vLLM's CPU_ATTN layout "
            "[blocks, kv_heads, block_size, 2*head] nor the flash layout "
            "[2, blocks, block_size, kv_heads, head]"
        )
    num_blocks, heads, block_size, fused = cache.shape
    head = fused // 2
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, head).chunk(2, dim=2)
    return key_cache, value_cache, block_size, head


def _cpu_isa(dtype: torch.dtype, block_size: int, head: int) -> str:
    try:  # a private vLLM function: guarded, so another vLLM fails by name, not by AttributeError
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except (ImportError, AttributeError) as exc:
        raise BlockLayoutError(
            "this vLLM has no CPU attention ISA lookup (vllm.v1.attention.backends.cpu_attn."
            f"_get_attn_isa: {exc}); the connector's CPU layout needs vLLM {SUPPORTED['vllm'][0]} up "
            f"to {SUPPORTED['vllm'][1]}"
        ) from exc
    return str(_get_attn_isa(dtype, block_size, head))
