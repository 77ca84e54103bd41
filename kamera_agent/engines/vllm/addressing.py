"""How each vLLM attention backend lays a token's KV out in the per-layer view it registers.

Why a table chosen at startup: the connector writes tokens where the attention kernel will read
them and reads back what the kernel's own cache write put there, so it must address each layer
exactly as its backend does. vLLM 0.32 (`vllm.v1.kv_cache_interface.create_kv_cache_views`)
hands ``register_kv_caches`` one logical view per layer, ``[blocks, heads, block_size, C]``,
whose physical strides follow the resolved ``KVCacheLayout`` (``LBNHC`` = NHD, ``LBHNC`` = HND,
or a block-outer ``BL*`` layout interleaving layers); ``C`` is a token's content per head. The
backends read it as follows (vLLM 0.32 source):

==============================  ===========================  ==================================
backend (``get_name()``)        ``C`` per head               what the kernel reads
==============================  ===========================  ==================================
FLASH_ATTN, TRITON_ATTN         ``head | head_v``            ``kv.transpose(1, 2).split(head)``
FLASHINFER                      ``head | head_v``            ``kv.permute(layer_view_order)
                                                             .split(head)``
CPU_ATTN (LBHNC only)           ``2 · head``                 its own op's packing of a
                                                             ``[heads, 2·block, head]`` slab
FLASHMLA, TRITON_MLA, CPU_MLA,  ``kv_lora_rank | rope``,     ``kv.squeeze(1)``: one latent row
CUTLASS_MLA, FLASH_ATTN_MLA,    one head                     per token (``MLAAttention.
FLASHINFER_MLA                                               bind_kv_cache``)
==============================  ===========================  ==================================

So every backend but CPU_ATTN is addressed by plain indexing of the view (any strides, any
device): keys are ``C[:split]``, values ``C[split:]``. MLA maps onto kamera's MLA layout
(`kamera_agent.operator.layout`: keys slot = the latent c_KV, values slot = k_pe) with the same
split at ``kv_lora_rank``. CPU_ATTN goes through vLLM's ``cpu_attn_reshape_and_cache`` (imported
only for it). Anything else (another backend, a quantized cache, a view of another shape)
raises `BlockAddressingError` when the layout is chosen, at ``register_kv_caches``, never in a step.

Slots are vLLM's: ``block * block_size + offset``, with ``block_size`` the view's (a kernel
block, where vLLM splits a manager block into kernel blocks: the same slot then addresses it).

This module imports no vLLM at load time (the GPU check uses it on a machine without vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kamera_agent.errors import KameraError
from kamera_agent.operator.layout import KVLayout

__all__ = [
    "BACKENDS",
    "BlockAddressingError",
    "LayerAddressing",
    "layer_addressing",
    "read_tokens",
    "write_tokens",
]

Addressing = Literal["paged", "latent", "cpu_attn"]

BACKENDS: dict[str, Addressing] = {
    "FLASH_ATTN": "paged",
    "FLASHINFER": "paged",
    "TRITON_ATTN": "paged",
    "CPU_ATTN": "cpu_attn",
    "FLASHMLA": "latent",
    "TRITON_MLA": "latent",
    "CPU_MLA": "latent",
    "CUTLASS_MLA": "latent",
    "FLASH_ATTN_MLA": "latent",
    "FLASHINFER_MLA": "latent",
}
"""vLLM attention backends (by ``get_name()``) the connector addresses, and how."""

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class BlockAddressingError(KameraError):
    """vLLM's KV cache is laid out in a way this connector cannot address (read or write)."""


@dataclass(frozen=True)
class LayerAddressing:
    """How one layer's registered view holds a token's KV.

    Attributes:
        backend: the attention backend's ``get_name()``.
        addressing: ``"paged"`` / ``"latent"`` (plain indexing) or ``"cpu_attn"`` (vLLM's op).
        split: features of the keys slot in ``C`` (``head``; MLA: ``kv_lora_rank``).
        width: features of ``C`` in all (keys then values; MLA: latent then k_pe).
    """

    backend: str
    addressing: Addressing
    split: int
    width: int


def layer_addressing(backend: str, cache: torch.Tensor, layout: KVLayout, heads: int) -> LayerAddressing:
    """How ``cache`` (a view vLLM registered) is addressed under ``backend``, checked against
    kamera's ``layout`` of the model with ``heads`` KV heads on this rank.

    Raises:
        BlockAddressingError: a backend this connector does not know, a quantized cache, or a view
            whose shape is not what that backend declares for this model.
    """
    addressing = BACKENDS.get(backend)
    if addressing is None:
        raise BlockAddressingError(
            f"vLLM runs attention with the {backend!r} backend, whose KV layout kamera's connector "
            f"does not know; choose one of {sorted(BACKENDS)} (--attention-backend / "
            "VLLM_ATTENTION_BACKEND) or run without the connector"
        )
    if cache.dtype not in _FLOATS:
        raise BlockAddressingError(
            f"the KV cache is stored as {cache.dtype} (a quantized kv_cache_dtype): kamera writes and "
            "reads unquantized KV only; serve with kv_cache_dtype='auto' or run without the connector"
        )
    if (addressing == "latent") != (layout.kind == "mla"):
        raise BlockAddressingError(
            f"the {backend} backend is {'an MLA' if addressing == 'latent' else 'a K/V'} backend but the "
            f"model's KV layout is {layout.kind!r}; this model and backend do not go together"
        )
    split = layout.keys_shape[1]
    width = split + layout.values_shape[1]
    if addressing == "cpu_attn" and layout.keys_shape[1] != layout.values_shape[1]:
        raise BlockAddressingError(
            f"vLLM's CPU attention packs keys and values of one width; this model's are "
            f"{layout.keys_shape[1]} and {layout.values_shape[1]}"
        )
    want = 1 if addressing == "latent" else heads
    if cache.ndim != 4 or cache.shape[1] != want or cache.shape[3] != width:
        parts = "latent | k_pe" if addressing == "latent" else "keys | values"
        raise BlockAddressingError(
            f"a {backend} KV cache layer has shape {tuple(cache.shape)}; for this model vLLM 0.32 "
            f"registers [blocks, {want}, block_size, {width}] ({parts}); is this another vLLM "
            "version, or a model whose head sizes differ from its config?"
        )
    if addressing == "cpu_attn":
        _check_cpu(cache)
    return LayerAddressing(backend, addressing, split, width)


def write_tokens(
    cache: torch.Tensor, where: LayerAddressing, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write ``keys`` / ``values`` ``[tokens, heads, dim]`` at ``slots`` ``[tokens]`` of one layer."""
    slots = slots.to(device=cache.device, dtype=torch.long)
    keys, values = keys.to(cache.device, cache.dtype), values.to(cache.device, cache.dtype)
    if where.addressing == "cpu_attn":
        _cpu_write(cache, keys, values, slots)
        return
    blocks, offsets = slots // cache.shape[2], slots % cache.shape[2]
    cache[blocks, :, offsets, : where.split] = keys
    cache[blocks, :, offsets, where.split : where.width] = values


def read_tokens(
    cache: torch.Tensor, where: LayerAddressing, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``[tokens, heads, dim]`` at ``slots`` of one layer, on its device."""
    slots = slots.to(device=cache.device, dtype=torch.long)
    if where.addressing == "cpu_attn":
        return _cpu_read(cache, slots)
    blocks, offsets = slots // cache.shape[2], slots % cache.shape[2]
    rows = cache[blocks, :, offsets]  # [tokens, heads, C]
    return rows[..., : where.split], rows[..., where.split : where.width]


# -- CPU_ATTN: vLLM's own packing ----------------------------------------------------------
# A (block, head) slab of [2 · block_size, head] rows: keys, then values. With the vec/vec16
# ISAs (fp32, and wherever AMX is absent) keys sit transposed ([head, block_size]) and values
# row-major; the AMX packing (bf16 on CPUs with AMX) is written by the op but not read back.


def _check_cpu(cache: torch.Tensor) -> None:
    """The CPU kernel reinterprets a block as one ``[heads, 2 · block, head]`` slab (contiguous
    LBHNC), and only the vec/vec16 packings can be read back (captures)."""
    if not cache.is_contiguous():
        raise BlockAddressingError(
            f"vLLM's CPU attention needs the LBHNC layout (a contiguous layer); this layer's strides are "
            f"{cache.stride()}: unset VLLM_KV_CACHE_LAYOUT"
        )
    isa = _cpu_isa(cache.dtype, cache.shape[2], cache.shape[3] // 2)
    if isa not in ("vec", "vec16"):
        raise BlockAddressingError(
            f"vLLM's CPU attention packs this cache for the {isa!r} ISA, which kamera cannot read back; "
            "serve in float32 or on a CPU without AMX, or run without the connector"
        )


def _cpu_write(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    from vllm._custom_ops import cpu_attn_reshape_and_cache

    num_blocks, heads, block_size, fused = cache.shape
    head = fused // 2
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, head).chunk(2, dim=2)
    isa = _cpu_isa(cache.dtype, block_size, head)
    cpu_attn_reshape_and_cache(keys.contiguous(), values.contiguous(), key_cache, value_cache, slots, isa)


def _cpu_read(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks, heads, block_size, fused = cache.shape
    head = fused // 2
    slabs = cache.view(num_blocks, heads, 2 * block_size * head)
    blocks, offsets = slots // block_size, slots % block_size
    keys = slabs[:, :, : block_size * head].view(num_blocks, heads, head, block_size)
    values = slabs[:, :, block_size * head :].view(num_blocks, heads, block_size, head)
    return keys[blocks, :, :, offsets], values[blocks, :, offsets, :]


def _cpu_isa(dtype: torch.dtype, block_size: int, head: int) -> str:
    from kamera_agent.engines.versions import SUPPORTED

    try:  # a private vLLM function: guarded, so another vLLM fails by name, not by AttributeError
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except (ImportError, AttributeError) as exc:
        raise BlockAddressingError(
            "this vLLM has no CPU attention ISA lookup (vllm.v1.attention.backends.cpu_attn."
            f"_get_attn_isa: {exc}); the connector's CPU layout needs vLLM {SUPPORTED['vllm'][0]} up "
            f"to {SUPPORTED['vllm'][1]}"
        ) from exc
    return str(_get_attn_isa(dtype, block_size, head))
