"""A stored chunk placed into SGLang's real MHA pool equals the model's own KV at the new positions.

The reference is the transformers model's own forward at SGLang's positions for that request
(1-D RoPE for Qwen2, M-RoPE for an image chunk of Qwen2-VL); the pool is SGLang's
``MHATokenToKVPool`` with slots from its ``TokenToKVPoolAllocator`` on CPU, float32.
"""

from __future__ import annotations

import pytest
import torch

from kamera_agent.backends.sglang.pool import read_chunk, write_chunk
from kamera_agent.operator.layout import to_position_free
from tests.backends.test_transformers_backend import images, text_backend, vl_backend

EXACT = 2e-5


def _pool(backend, page_size: int, size: int = 256):  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    layout = backend.layout
    (heads, head_dim), (_, v_dim) = layout.keys_shape, layout.values_shape
    pool = MHATokenToKVPool(
        size,
        1,
        torch.float32,
        heads,
        head_dim,
        layout.num_layers,
        "cpu",
        False,
        v_head_dim=v_dim,
        enable_alt_stream=False,
    )
    if page_size == 1:
        return pool, TokenToKVPoolAllocator(size, torch.float32, "cpu", pool, need_sort=False)
    return pool, PagedTokenToKVPoolAllocator(size, page_size, torch.float32, "cpu", pool, need_sort=False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_a_chunk_stored_at_one_place_is_written_exactly_at_another(family: str, page_size: int) -> None:
    backend = text_backend("qwen2", layers=4) if family == "qwen2" else vl_backend("qwen2_vl", layers=4)
    encoder = backend.encoder
    chunk = (
        encoder.text("the red ball rolled under the table")
        if family == "qwen2"
        else encoder.image(images(1, 3)[0])
    )
    (stored,) = backend.prefill_sequence([chunk])  # where it was first seen
    position_free = to_position_free(stored, backend.layout)
    (truth,) = backend.prefill_sequence([chunk], shift=37)  # the model's own KV 37 positions later
    pool, allocator = _pool(backend, page_size)
    free = allocator.available_size()
    pages = allocator.alloc(-(-chunk.num_tokens // page_size) * page_size)  # whole pages
    slots = pages[: chunk.num_tokens]
    assert truth.positions is not None
    write_chunk(pool, position_free, backend.layout, truth.positions, slots)
    for layer in range(backend.layout.num_layers):
        got_k = pool.get_key_buffer(layer)[slots].transpose(0, 1)
        got_v = pool.get_value_buffer(layer)[slots].transpose(0, 1)
        assert _rel(got_k, truth.keys[layer]) < EXACT and _rel(got_v, truth.values[layer]) < EXACT
    back = read_chunk(pool, backend.layout, slots, truth.positions, chunk.key)  # capture: the way back
    assert _rel(back.keys, position_free.keys) < EXACT and _rel(back.values, position_free.values) < EXACT
    allocator.free(pages)
    assert allocator.available_size() == free  # every slot back
