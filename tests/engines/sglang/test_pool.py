"""A stored chunk placed into SGLang's real token pools equals the model's own KV at the new positions.

The reference is the transformers model's own forward at SGLang's positions for that request
(1-D RoPE for Qwen2, M-RoPE for an image chunk of Qwen2-VL, MLA for DeepSeek-V2/V3); the pools
are SGLang's ``MHATokenToKVPool`` and ``MLATokenToKVPool`` with slots from its allocators on CPU,
float32. For MLA the pool's rope band is in SGLang's feature order, which for DeepSeek-V3 with
``rope_interleave`` is a permutation of the band transformers caches: checked against SGLang's
own rotary class too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from kamera_agent.backends import TransformersBackend
from kamera_agent.engines.sglang.pool import SGLangSlots
from kamera_agent.operator.layout import to_position_free
from kamera_agent.operator.rope import Pairing
from tests.backends.test_transformers_backend import images, sharpen, text_backend, vl_backend
from tests.tiny_models import tiny_deepseek_v3
from tests.tiny_processors import tiny_tokenizer

EXACT = 2e-5
ROOT = Path(__file__).resolve().parents[3]
MLA_FAMILIES = ["deepseek_v2", "deepseek_v3", "deepseek_v3_nointerleave"]


def _pool(backend, page_size: int, size: int = 256):  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    layout = backend.layout
    (heads, head_dim), (_, v_dim) = layout.keys_shape, layout.values_shape
    if layout.kind == "mla":  # (kv_lora_rank, qk_rope_head_dim)
        pool = MLATokenToKVPool(
            size, page_size, torch.float32, head_dim, v_dim, layout.num_layers, "cpu", False
        )
    else:
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
    SGLangSlots(pool, backend.layout).write(position_free, truth.positions, slots)
    for layer in range(backend.layout.num_layers):
        got_k = pool.get_key_buffer(layer)[slots].transpose(0, 1)
        got_v = pool.get_value_buffer(layer)[slots].transpose(0, 1)
        assert _rel(got_k, truth.keys[layer]) < EXACT and _rel(got_v, truth.values[layer]) < EXACT
    back = SGLangSlots(pool, backend.layout).read(slots, truth.positions, chunk.key)  # capture: the way back
    assert _rel(back.keys, position_free.keys) < EXACT and _rel(back.values, position_free.values) < EXACT
    allocator.free(pages)
    assert allocator.available_size() == free  # every slot back


# -- MLA ---------------------------------------------------------------------------------------


@cache
def _mla_backend(family: str) -> TransformersBackend:
    if family == "deepseek_v3_nointerleave":  # half-split k_pe in the checkpoint as well
        model = tiny_deepseek_v3(rope_interleave=False, num_hidden_layers=4)
        return TransformersBackend(sharpen(model), tokenizer=tiny_tokenizer())
    return text_backend(family, layers=4)


def _sglang_pairing(config: Any) -> Pairing:
    """The pairing SGLang's DeepseekV2AttentionMLA gives its rotary (models/deepseek_v2.py:
    ``is_neox_style = not getattr(config, "rope_interleave", True)``, for V2 and V3 alike)."""
    return "interleaved" if getattr(config, "rope_interleave", True) else "half"


def _as_transformers_caches(band: torch.Tensor, sglang: Pairing, transformers: Pairing) -> torch.Tensor:
    """SGLang's rope band ``[..., 2F]`` in the order transformers caches it. DeepSeek-V3's
    ``apply_rotary_pos_emb_interleave`` rotates pairs (2i, 2i + 1) and returns them as
    ``cat([evens, odds])``, half-split; SGLang's GPT-J style rotation keeps them in place."""
    if sglang == transformers:
        return band
    assert (sglang, transformers) == ("interleaved", "half")
    return torch.cat([band[..., 0::2], band[..., 1::2]], dim=-1)


@pytest.fixture
def dcp_off() -> Iterator[None]:
    """No decode context parallelism: what a published single-rank SGLang server states, and
    what ``MLATokenToKVPool.set_mla_kv_buffer`` reads (its write locs are not widened)."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0):
        yield


def _truth_and_raw_k_pe(backend: TransformersBackend, chunk: Any) -> tuple[Any, torch.Tensor]:
    """The model's own KV of ``chunk`` 37 positions later, and its k_pe before rotation
    (``kv_a_proj_with_mqa``'s rope part, in the checkpoint's feature order) ``[L, n, 2F]``."""
    config, raw = backend.model.config, {}
    layers = backend.model.model.layers

    def keep(layer: int) -> Any:
        return lambda module, args, out: raw.__setitem__(
            layer, out[0, :, config.kv_lora_rank :].detach().clone()
        )

    hooks = [
        layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(keep(i)) for i, layer in enumerate(layers)
    ]
    try:
        (truth,) = backend.prefill_sequence([chunk], shift=37)  # the chunk's forward comes last
    finally:
        for hook in hooks:
            hook.remove()
    return truth, torch.stack([raw[i] for i in range(len(layers))])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_a_chunk_is_written_exactly_into_sglangs_mla_pool(family: str, page_size: int, dcp_off: None) -> None:
    backend = _mla_backend(family)
    layout, config = backend.layout, backend.model.config
    chunk = backend.encoder.text("the red ball rolled under the table")
    (stored,) = backend.prefill_sequence([chunk])
    position_free = to_position_free(stored, layout)
    (truth,) = backend.prefill_sequence([chunk], shift=37)
    assert truth.positions is not None
    pairing, rank = _sglang_pairing(config), layout.keys_shape[1]
    pool, allocator = _pool(backend, page_size)
    free = allocator.available_size()
    pages = allocator.alloc(-(-chunk.num_tokens // page_size) * page_size)
    slots = pages[: chunk.num_tokens]
    SGLangSlots(pool, layout, pool_pairing=pairing).write(position_free, truth.positions, slots)
    for layer in range(layout.num_layers):
        row = pool.get_key_buffer(layer)[slots].transpose(0, 1)  # [1, n, kv_lora_rank + rope]
        latent, band = row[..., :rank], row[..., rank:]
        assert _rel(latent, truth.keys[layer]) < EXACT
        assert torch.equal(pool.get_value_buffer(layer)[slots].transpose(0, 1), latent)  # MLA's V is c_KV
        assert _rel(_as_transformers_caches(band, pairing, layout.rope.pairing), truth.values[layer]) < EXACT
        if pairing != layout.rope.pairing:  # the permutation is not a no-op here
            assert _rel(band, truth.values[layer]) > 0.1
    back = SGLangSlots(pool, layout, pool_pairing=pairing).read(slots, truth.positions, chunk.key)
    assert _rel(back.keys, position_free.keys) < EXACT and _rel(back.values, position_free.values) < EXACT
    assert back.positions is None and back.chunk_key == chunk.key
    allocator.free(pages)
    assert allocator.available_size() == free


# SGLang's RotaryEmbedding, built off CUDA, imports vllm's kernel unless SGLang runs as its CPU
# engine (SGLANG_USE_CPU_ENGINE=1, read once per process and changing other SGLang classes), so
# its rotary runs in a child process in that mode.
_SGLANG_ROTARY = """
import sys, torch
from sglang.srt.layers.rotary_embedding import get_rope
from kamera_agent.engines.sglang.pool import rotary_pairing
out = {}
for name, job in torch.load(sys.argv[1]).items():
    dim = job["dim"]  # as DeepseekV2AttentionMLA builds it, default rope (rope_scaling None)
    neox, theta = job["neox"], job["theta"]
    rope = get_rope(dim, dim, job["max_position"], theta, is_neox_style=neox, dtype=torch.float32)
    k_pe = [rope.forward_native(job["positions"], torch.zeros_like(k), k.clone())[1] for k in job["raw"]]
    out[name] = {"pairing": rotary_pairing(rope), "k_pe": torch.stack(k_pe)}
torch.save(out, sys.argv[2])
"""


def test_sglangs_own_rotary_puts_the_band_where_kamera_writes_it(tmp_path: Path, dcp_off: None) -> None:
    jobs, truths = {}, {}
    for family in MLA_FAMILIES:
        backend = _mla_backend(family)
        config = backend.model.config
        chunk = backend.encoder.text("the red ball rolled under the table")
        truth, raw = _truth_and_raw_k_pe(backend, chunk)
        truths[family] = (backend, chunk, truth)
        jobs[family] = {
            "dim": int(config.qk_rope_head_dim),
            "max_position": int(config.max_position_embeddings),
            "theta": float(config.rope_parameters["rope_theta"]),
            "neox": not getattr(config, "rope_interleave", True),  # deepseek_v2.py, DeepseekV2AttentionMLA
            "positions": truth.positions,
            "raw": raw[:, :, None, :],  # [L, n, 1 head, 2F]
        }
    torch.save(jobs, tmp_path / "jobs.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    ran = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-c",
            _SGLANG_ROTARY,
            str(tmp_path / "jobs.pt"),
            str(tmp_path / "out.pt"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    sglang = torch.load(tmp_path / "out.pt")
    for family, (backend, chunk, truth) in truths.items():
        layout = backend.layout
        pairing = sglang[family]["pairing"]
        assert pairing == _sglang_pairing(backend.model.config)
        pool, allocator = _pool(backend, 1)
        slots = allocator.alloc(chunk.num_tokens)
        SGLangSlots(pool, layout, pool_pairing=pairing).write(
            to_position_free(truth, layout), truth.positions, slots
        )
        rank = layout.keys_shape[1]
        for layer in range(layout.num_layers):
            band = pool.get_key_buffer(layer)[slots][:, :, rank:]  # [n, 1, 2F]
            assert _rel(band, sglang[family]["k_pe"][layer]) < EXACT, (family, layer)
        allocator.free(slots)


def test_a_pool_of_the_other_kind_is_refused_before_anything_is_written() -> None:
    from kamera_agent.errors import LayoutMismatchError

    mla, mha = _mla_backend("deepseek_v2"), text_backend("qwen2", layers=4)
    for backend, other in ((mla, mha), (mha, mla)):
        pool, _ = _pool(other, 1)
        with pytest.raises(LayoutMismatchError, match="needs SGLang's"):
            SGLangSlots(pool, backend.layout)  # at construction: before any load or capture
