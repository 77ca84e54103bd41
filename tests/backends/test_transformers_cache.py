"""`BufferedLayer` against transformers' own ``DynamicCache``: the same logits through appends,
growth past its capacity, crops and decode steps, on a GQA and an MLA family."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

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
