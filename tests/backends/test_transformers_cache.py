"""`BufferedLayer` against transformers' own ``DynamicCache``: the same logits through appends,
growth past its capacity, crops and decode steps, on a GQA and an MLA family."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import DynamicCache

from kamera_agent.backends.transformers import read_chunk, read_chunks
from kamera_agent.backends.transformers.cache import BufferedLayer, buffered_cache
from tests.backends.test_transformers_backend import text_backend


@pytest.mark.parametrize("name", ["qwen2", "deepseek_v3"])
def test_a_buffered_cache_gives_the_logits_of_a_dynamic_cache(name: str) -> None:
    backend = text_backend(name, layers=4)
    config = backend.model.config
    buffered, plain = buffered_cache(config), DynamicCache(config=config)
    assert all(isinstance(layer, BufferedLayer) for layer in buffered.layers)
    generator = torch.Generator().manual_seed(0)
    position = 0
    # 40 then 30 tokens: the second append grows the 64-slot buffer; then single decode steps.
    for n in (40, 30, 1, 1, 1):
        ids = torch.randint(0, config.vocab_size, (n,), generator=generator)
        positions = torch.arange(position, position + n)
        buffered, got = backend.forward_tokens(ids, positions, buffered)
        plain, want = backend.forward_tokens(ids, positions, plain)
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        position += n
    assert buffered.get_seq_length() == plain.get_seq_length() == 73
    buffered.crop(-33)  # back to the first 40 tokens, then a different continuation
    plain.crop(-33)
    ids = torch.randint(0, config.vocab_size, (5,), generator=generator)
    buffered, got = backend.forward_tokens(ids, torch.arange(40, 45), buffered)
    plain, want = backend.forward_tokens(ids, torch.arange(40, 45), plain)
    assert got is not None and want is not None
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert buffered.get_seq_length() == 45


def test_appends_write_into_spare_capacity_without_copying_what_is_held() -> None:
    layer = BufferedLayer()
    first = torch.randn(1, 2, 10, 4)
    layer.update(first, first.clone())
    buffer = layer.keys.untyped_storage().data_ptr()
    for _ in range(5):
        step = torch.randn(1, 2, 1, 4)
        keys, _ = layer.update(step, step.clone())
    assert keys.untyped_storage().data_ptr() == buffer  # the same buffer: nothing was reallocated
    torch.testing.assert_close(keys[..., :10, :], first)
    layer.crop(-3)
    assert layer.keys.shape[-2] == 12
    with pytest.raises(ValueError, match="negative"):
        layer.crop(2)


@pytest.mark.parametrize("name", ["qwen2", "deepseek_v3"])
def test_reading_a_run_at_once_gives_each_chunk_what_reading_it_alone_gives(name: str) -> None:
    """`read_chunks` both ways (the whole run sliced once, as on a GPU; each chunk alone, as on a
    CPU) equals `read_chunk` per chunk bit for bit, each chunk in tensors of its own."""
    backend = text_backend(name, layers=4)
    config = backend.model.config
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    cache, _ = backend.forward_tokens(ids, torch.arange(40), buffered_cache(config))
    sizes, start = [5, 17, 11], 4
    bounds = [start + sum(sizes[:i]) for i in range(len(sizes) + 1)]
    positions = [torch.arange(a, b) + 100 for a, b in itertools.pairwise(bounds)]
    alone = [
        read_chunk(cache, backend.layout, a, b, where, chunk_key=f"c{i}", model_fingerprint="fp")
        for i, ((a, b), where) in enumerate(zip(itertools.pairwise(bounds), positions, strict=True))
    ]
    keys = [f"c{i}" for i in range(len(sizes))]
    for whole_run in (True, False, None):
        got = read_chunks(
            cache, backend.layout, start, positions, keys, model_fingerprint="fp", whole_run=whole_run
        )
        for kv, want in zip(got, alone, strict=True):
            assert torch.equal(kv.keys, want.keys) and torch.equal(kv.values, want.values)
            assert torch.equal(kv.positions, want.positions) and (kv.chunk_key, kv.model_fingerprint) == (
                want.chunk_key,
                "fp",
            )
            for tensor in (kv.keys, kv.values):
                assert tensor.is_contiguous()
                assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_a_caches_bytes_are_its_buffers_whole_each_counted_once() -> None:
    """What a server bounds its windows by: the buffers' capacity (spare slots included), the
    views attention reads and the keys' and values' shared storages counted once, no weights."""
    backend = text_backend("qwen2", layers=4)
    config = backend.model.config
    cache = buffered_cache(config)
    cache, _ = backend.forward_tokens(torch.arange(40), torch.arange(40), cache)
    layers = cache.layers
    capacity = sum(layer._keys.nbytes + layer._values.nbytes for layer in layers)
    assert layers[0]._keys.shape[-2] == 64 and layers[0].keys.shape[-2] == 40  # spare slots held
    assert backend.cache_nbytes(cache) == capacity
    cache.crop(-20)  # a crop moves the fill mark: nothing is freed
    assert backend.cache_nbytes(cache) == capacity
    plain = DynamicCache(config=config)
    plain, _ = backend.forward_tokens(torch.arange(40), torch.arange(40), plain)
    exact = sum(layer.keys.nbytes + layer.values.nbytes for layer in plain.layers)
    assert backend.cache_nbytes(plain) == exact < capacity
