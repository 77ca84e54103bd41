"""Each vLLM attention backend's KV layout, built as vLLM 0.32 builds it, written and read by kamera.

The per-layer views are vLLM's own (`create_kv_cache_views` over one backing buffer, every
``KVCacheLayout`` a backend accepts, kernel-block splitting included); what each backend reads
is taken as its kernel unpacks the view (FlashAttention / Triton: ``kv.transpose(1, 2).split``;
FlashInfer, which does not import here: a replica of its ``permute(layer_view_order).split``
read in its NHD/HND convention; MLA: ``kv.squeeze(1)``); CPU_ATTN and CPU_MLA are written by
vLLM's own cache writers and read back by kamera.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.utils import get_flashinfer_layout_string
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kamera_agent.engines.shards import even_stages
from kamera_agent.engines.vllm.addressing import (
    BACKENDS,
    BlockAddressingError,
    layer_addressing,
    read_tokens,
    write_tokens,
)
from kamera_agent.engines.vllm.blocks import VLLMSlots, place_layers
from kamera_agent.errors import LayoutMismatchError
from kamera_agent.operator.layout import ChunkKV, KVLayout
from kamera_agent.operator.rope import RotarySpec

pytestmark = pytest.mark.vllm

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 2, 6, 16, 2, 32
LORA, ROPE = 64, 16
ALL_LAYOUTS = tuple(KVCacheLayout)


def _rope(dim: int) -> RotarySpec:
    return RotarySpec(inv_freq=1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), pairing="half")


GQA = KVLayout("gqa", LAYERS, (HEADS, HEAD), (HEADS, HEAD), "keys", _rope(HEAD))
MLA = KVLayout("mla", LAYERS, (1, LORA), (1, ROPE), "values", _rope(ROPE))


def _views(
    layout: KVCacheLayout, *, mla: bool = False, dtype: torch.dtype = torch.float32, kernel: int | None = None
) -> list[torch.Tensor]:
    """One view per layer, as vLLM's ``allocate_kv_cache`` makes them."""
    if mla:
        width = LORA + ROPE
        spec: FullAttentionSpec = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=width, dtype=dtype
        )
    else:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=dtype)
    strides = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = LAYERS * BLOCKS * spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=strides[0], block_stride=strides[1])
    raw = torch.zeros(size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel_block_size=kernel)


def _tokens(
    n: int, heads: int, dk: int, dv: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:n]
    return slots, torch.randn(n, heads, dk, generator=g), torch.randn(n, heads, dv, generator=g)


def _flash_read(kv: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's and Triton's unpacking (``flash_attn.py``: ``(B, H, N, 2*D) -> (B, N, H, D)``)."""
    key_cache, value_cache = kv.transpose(1, 2).split(HEAD, dim=-1)
    n = key_cache.shape[1]
    return key_cache[slots // n, slots % n], value_cache[slots // n, slots % n]


def _flashinfer_read(
    kv: torch.Tensor, layout: KVCacheLayout, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's unpacking (``flashinfer.py`` forward): the view permuted to its physical order
    and split, its kernels told NHD or HND (`get_flashinfer_layout_string`)."""
    physical = kv.permute(*layout.layer_view_order)
    k, v = physical.split(HEAD, dim=-1)
    n = kv.shape[2]
    blocks, offsets = slots // n, slots % n
    if get_flashinfer_layout_string(layout) == "NHD":  # [B, N, H, D]
        return k[blocks, offsets], v[blocks, offsets]
    return k[blocks, :, offsets], v[blocks, :, offsets]  # HND: [B, H, N, D]


def test_the_table_names_vllms_own_backends() -> None:
    for cls in (FlashAttentionBackend, TritonAttentionBackend, CPUAttentionBackend):
        assert BACKENDS[cls.get_name()] in ("paged", "cpu_attn")
        assert not cls.is_mla()
    for cls in (FlashMLABackend, TritonMLABackend, CPUMLABackend):
        assert BACKENDS[cls.get_name()] == "latent" and cls.is_mla()


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda m: m.name)
@pytest.mark.parametrize(
    "backend", [FlashAttentionBackend, TritonAttentionBackend], ids=lambda b: str(b.get_name())
)
def test_flash_and_triton_read_what_kamera_wrote(backend: type, layout: KVCacheLayout) -> None:
    assert backend.supported_kv_cache_layouts() is None  # any layout: every one is tried
    slots, keys, values = _tokens(40, HEADS, HEAD, HEAD, seed=1)
    for cache in _views(layout):
        where = layer_addressing(backend.get_name(), cache, GQA, HEADS)
        write_tokens(cache, where, keys, values, slots)
        got_k, got_v = _flash_read(cache, slots)
        assert torch.equal(got_k, keys) and torch.equal(got_v, values)
        back_k, back_v = read_tokens(cache, where, slots)
        assert torch.equal(back_k, keys) and torch.equal(back_v, values)


FLASHINFER_LAYOUTS = [m for m in ALL_LAYOUTS if m.name != "LHBNC"]  # LHBNC has no FlashInfer name


@pytest.mark.parametrize("layout", FLASHINFER_LAYOUTS, ids=lambda m: m.name)
def test_flashinfer_reads_what_kamera_wrote(layout: KVCacheLayout) -> None:
    slots, keys, values = _tokens(40, HEADS, HEAD, HEAD, seed=2)
    for cache in _views(layout, dtype=torch.bfloat16):
        where = layer_addressing("FLASHINFER", cache, GQA, HEADS)
        write_tokens(cache, where, keys, values, slots)
        got_k, got_v = _flashinfer_read(cache, layout, slots)
        assert torch.equal(got_k, keys.bfloat16()) and torch.equal(got_v, values.bfloat16())


def test_kernel_blocks_are_addressed_by_the_managers_slots() -> None:
    """vLLM splits a 32-token manager block into two 16-token kernel blocks: the connector's
    slots (``block_id * 32 + offset``) land where the unsplit view has them."""
    slots, keys, values = _tokens(30, HEADS, HEAD, HEAD, seed=3)
    global BLOCK
    saved, BLOCK = BLOCK, 32
    try:
        raw_split = _views(KVCacheLayout.LBNHC, kernel=16)
        whole = [v.view(v.shape[0] // 2, 2, *v.shape[1:]) for v in raw_split]
    finally:
        BLOCK = saved
    cache = raw_split[0]
    assert cache.shape[2] == 16
    where = layer_addressing("FLASH_ATTN", cache, GQA, HEADS)
    write_tokens(cache, where, keys, values, slots)
    # the manager's view of the same bytes: [blocks, 2 kernel blocks, H, 16, C]
    manager = whole[0]
    blocks, offsets = slots // 32, slots % 32
    rows = manager[blocks, offsets // 16, :, offsets % 16]
    assert torch.equal(rows[..., :HEAD], keys) and torch.equal(rows[..., HEAD:], values)


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda m: m.name)
@pytest.mark.parametrize("backend", ["FLASHMLA", "TRITON_MLA", "CPU_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA"])
def test_mla_backends_read_one_latent_row_per_token(backend: str, layout: KVCacheLayout) -> None:
    """MLA: ``[blocks, 1, block_size, kv_lora_rank + rope]``, which ``MLAAttention.bind_kv_cache``
    squeezes to the kernels' ``[blocks, block_size, C]``: kamera's keys slot (the latent) first,
    its values slot (k_pe) after."""
    slots, latent, k_pe = _tokens(40, 1, LORA, ROPE, seed=4)
    for cache in _views(layout, mla=True):
        where = layer_addressing(backend, cache, MLA, heads=HEADS)
        write_tokens(cache, where, latent, k_pe, slots)
        rows = cache.squeeze(1)  # what the MLA kernels get
        n = rows.shape[1]
        got = rows[slots // n, slots % n]
        assert torch.equal(got[:, :LORA], latent[:, 0]) and torch.equal(got[:, LORA:], k_pe[:, 0])
        back_l, back_pe = read_tokens(cache, where, slots)
        assert torch.equal(back_l, latent) and torch.equal(back_pe, k_pe)


def test_kamera_reads_what_vllms_cpu_mla_writer_wrote() -> None:
    slots, latent, k_pe = _tokens(40, 1, LORA, ROPE, seed=5)
    cache = _views(KVCacheLayout.LBNHC, mla=True)[0]
    CPUMLAImpl.do_kv_cache_update(None, latent[:, 0], k_pe, cache, slots, "auto", torch.ones(()))  # type: ignore[arg-type]
    where = layer_addressing("CPU_MLA", cache, MLA, heads=1)
    back_l, back_pe = read_tokens(cache, where, slots)
    assert torch.equal(back_l, latent) and torch.equal(back_pe, k_pe)


def test_cpu_attention_round_trips_through_vllms_own_op() -> None:
    """CPU_ATTN accepts LBHNC only; its cache writer is vLLM's op, which kamera's read undoes."""
    from vllm._custom_ops import cpu_attn_reshape_and_cache
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    assert CPUAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)
    slots, keys, values = _tokens(40, HEADS, HEAD, HEAD, seed=6)
    cache = _views(KVCacheLayout.LBHNC)[1]
    where = layer_addressing("CPU_ATTN", cache, GQA, HEADS)
    write_tokens(cache, where, keys, values, slots)
    back_k, back_v = read_tokens(cache, where, slots)
    assert torch.equal(back_k, keys) and torch.equal(back_v, values)
    # vLLM's own writer, straight from the keys, reads back the same
    other = _views(KVCacheLayout.LBHNC)[0]
    k_cache, v_cache = other.view(BLOCKS, HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
    isa = _get_attn_isa(torch.float32, BLOCK, HEAD)
    cpu_attn_reshape_and_cache(keys, values, k_cache, v_cache, slots, isa)
    assert torch.equal(other, cache)


def test_the_slots_relocate_and_round_trip_every_layer() -> None:
    """`VLLMSlots` over FlashAttention views: a position-free chunk written at positions reads
    back position-free (rotation and its inverse, fp32 rounding)."""
    caches = _views(KVCacheLayout.LBHNC)
    pool = VLLMSlots.of(caches, ["FLASH_ATTN"] * LAYERS, GQA, HEADS)
    g = torch.Generator().manual_seed(7)
    shape = (LAYERS, HEADS, 20, HEAD)
    kv = ChunkKV(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    slots, positions = torch.arange(30, 50), torch.arange(100, 120)
    pool.write(kv, positions, slots)
    back = pool.read(slots, positions)
    assert torch.allclose(back.keys, kv.keys, atol=1e-5) and torch.equal(back.values, kv.values)
    placed_k, _ = _flash_read(caches[1], slots)
    assert not torch.allclose(placed_k, kv.keys[1].transpose(0, 1), atol=1e-3)  # rotated in the cache


def test_unknown_backends_quantized_caches_and_foreign_shapes_fail_at_startup() -> None:
    cache = _views(KVCacheLayout.LBNHC)[0]
    with pytest.raises(BlockAddressingError, match="FLEX_ATTENTION"):
        layer_addressing("FLEX_ATTENTION", cache, GQA, HEADS)
    with pytest.raises(BlockAddressingError, match="quantized"):
        layer_addressing("FLASH_ATTN", cache.view(torch.uint8), GQA, HEADS)
    with pytest.raises(BlockAddressingError, match=r"\[blocks, 4, block_size, 64\]"):
        layer_addressing("FLASH_ATTN", cache, GQA, 4)
    with pytest.raises(BlockAddressingError, match="MLA"):
        layer_addressing("FLASHMLA", cache, GQA, HEADS)
    with pytest.raises(BlockAddressingError, match="LBHNC"):
        layer_addressing("CPU_ATTN", _views(KVCacheLayout.LBNHC)[0], GQA, HEADS)


def _named(names: list[str]) -> dict[str, torch.Tensor]:
    """A distinct FlashAttention view (vLLM's own) for each name."""
    caches: list[torch.Tensor] = []
    while len(caches) < len(names):
        caches += _views(KVCacheLayout.LBNHC)
    return dict(zip(names, caches[: len(names)], strict=True))


def test_caches_are_placed_by_their_layer_names_and_draft_layers_skipped() -> None:
    """Names, not registration order, say which layer a cache is (vLLM's ``extract_layer_index``);
    a draft model's caches (EAGLE/MTP: another prefix, an index past the model's) are skipped."""
    from vllm.model_executor.models.utils import extract_layer_index

    names = ["model.layers.1.self_attn.attn", "model.layers.0.self_attn.attn", "draft.layers.2.attn"]
    caches = _named(names)
    backends = dict.fromkeys(names, "FLASH_ATTN")
    placed, skipped = place_layers(caches, backends, GQA, HEADS, extract_layer_index)
    assert skipped == ["draft.layers.2.attn"]
    pool = VLLMSlots(placed, GQA)
    assert [p.name for p in pool.layers] == names[1::-1] and (pool.first, pool.end) == (0, LAYERS)
    assert pool.caches[0] is caches["model.layers.0.self_attn.attn"]


def test_a_pipeline_stage_writes_its_own_layers_of_a_chunk() -> None:
    """A stage holding layers 2..3 of a 4-layer model reads and writes exactly those layers of a
    chunk (its piece), never the model's layers 0..1 into its first caches."""
    from vllm.model_executor.models.utils import extract_layer_index

    four = KVLayout("gqa", 4, (HEADS, HEAD), (HEADS, HEAD), "keys", _rope(HEAD))
    names = ["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"]
    placed, skipped = place_layers(
        _named(names), dict.fromkeys(names, "FLASH_ATTN"), four, HEADS, extract_layer_index
    )
    pool = VLLMSlots(placed, four)
    assert not skipped and (pool.first, pool.end) == (2, 4)
    g = torch.Generator().manual_seed(3)
    piece = ChunkKV(torch.randn(2, HEADS, 8, HEAD, generator=g), torch.randn(2, HEADS, 8, HEAD, generator=g))
    slots, positions = torch.arange(8), torch.arange(40, 48)
    pool.write(piece, positions, slots)
    back = pool.read(slots, positions)
    assert torch.allclose(back.keys, piece.keys, atol=1e-5) and torch.equal(back.values, piece.values)
    whole = ChunkKV(torch.randn(4, HEADS, 8, HEAD), torch.randn(4, HEADS, 8, HEAD))
    with pytest.raises(LayoutMismatchError, match=r"layers 2\.\.3"):
        pool.write(whole, positions, slots)


def test_a_layer_sharing_another_layers_cache_is_read_never_written_twice() -> None:
    """vLLM's cross-layer KV sharing: layer 1 attends over layer 0's cache. Writing a chunk
    writes layer 0's KV there once; reading gives layer 0's KV for both layers."""
    from vllm.model_executor.models.utils import extract_layer_index

    cache = _views(KVCacheLayout.LBNHC)[0]
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    placed, _ = place_layers(
        dict.fromkeys(names, cache), dict.fromkeys(names, "FLASH_ATTN"), GQA, HEADS, extract_layer_index
    )
    assert [p.shared for p in placed] == [False, True]
    g = torch.Generator().manual_seed(5)
    kv = ChunkKV(
        torch.randn(LAYERS, HEADS, 4, HEAD, generator=g), torch.randn(LAYERS, HEADS, 4, HEAD, generator=g)
    )
    pool, slots, positions = VLLMSlots(placed, GQA), torch.arange(4), torch.arange(4)
    pool.write(kv, positions, slots)
    back = pool.read(slots, positions)
    assert torch.equal(back.values[1], kv.values[0]) and torch.equal(back.values[0], kv.values[0])


def test_even_stages_are_vllms_own_partition() -> None:
    from vllm.distributed.utils import get_pp_indices

    for layers, stages in ((4, 2), (7, 3), (28, 4), (61, 4)):
        assert list(even_stages(layers, stages)) == [get_pp_indices(layers, r, stages) for r in range(stages)]


@pytest.mark.parametrize(
    ("backend", "layout"),
    [
        ("FLASH_ATTN", KVCacheLayout.LBNHC),
        ("FLASH_ATTN", KVCacheLayout.LBHNC),
        ("CPU_ATTN", KVCacheLayout.LBHNC),
    ],
)
def test_whole_blocks_copied_then_unpacked_are_the_tokens_read_in_place(
    backend: str, layout: KVCacheLayout
) -> None:
    """What a capture copies on vLLM's step (the blocks holding its slots, whole) and unpacks on
    its writer's thread is what reading the slots in place gives: scattered slots, a block met
    twice out of order, a partial block."""
    caches = _views(layout)
    pool = VLLMSlots.of(caches, [backend] * LAYERS, GQA, HEADS)
    for seed in range(3):
        slots, keys, values = _tokens(40, HEADS, HEAD, HEAD, seed=20 + seed)
        for cache in caches:
            write_tokens(cache, layer_addressing(backend, cache, GQA, HEADS), keys, values, slots)
        slots = torch.cat([slots[:25], slots[:3], slots[25:]])  # a block again, after others
        copies, rows = pool.copy_blocks(slots)
        assert all(c.is_contiguous() and c.shape[0] <= len(slots) for c in copies)
        got_k, got_v = pool.unpack(copies, rows)
        for i, cache in enumerate(caches):
            want_k, want_v = read_tokens(cache, layer_addressing(backend, cache, GQA, HEADS), slots)
            assert torch.equal(got_k[i], want_k.transpose(0, 1)) and torch.equal(
                got_v[i], want_v.transpose(0, 1)
            )
