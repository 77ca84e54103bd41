"""Sliding-window layers (Gemma 3's shape: local layers of a small window beside global ones,
each kind with its own rotary base): windows reaching far past the window answer like the
model's own forward, and the masks by position are what makes them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import Gemma3Config, LlamaConfig, MistralConfig

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.backends.transformers.families import family_of
from kamera_agent.backends.transformers.windows import sliding_layers
from kamera_agent.config import WindowConfig
from kamera_agent.errors import UnsupportedModelError
from kamera_agent.window import KameraWindow
from tests.backends.test_transformers_backend import sharpen
from tests.tiny_models import GEMMA3_WINDOW, tiny_gemma3
from tests.tiny_processors import tiny_tokenizer
from tests.window.backends import backend_named
from tests.window.helpers import answer_kl, chunk_errors

TEXTS = ["the red ball rolls", "green box moves left", "a cat sat on the mat", "blue sky", "it rains"]


def _window(backend: TransformersBackend) -> KameraWindow:
    window = KameraWindow(backend, config=WindowConfig.exact(capacity_chunks=4))
    refs = [window.push(text) for text in TEXTS[:4]]
    window.reorder([refs[2], refs[0], refs[1], refs[3]])
    window.slide(1)
    window.push(TEXTS[4])
    if refs[2] not in window.refs:
        window.recall(refs[2])
    return window


def test_an_exact_window_far_past_the_sliding_window_answers_like_the_models_own_forward() -> None:
    backend = backend_named("gemma3")
    assert backend.sliding is not None and backend.sliding.window == GEMMA3_WINDOW
    assert backend.layout.rope.per_layer  # two bases: each layer relocated with its own
    window = _window(backend)
    assert sum(window.chunk(ref).num_tokens for ref in window.refs) > 8 * GEMMA3_WINDOW
    assert max(chunk_errors(window).values()) <= 2e-5
    assert answer_kl(window) < 1e-9


def test_the_window_masks_are_what_makes_the_answer_right() -> None:
    """The same backend with its windows unmasked (every layer sees all keys) is far from the
    model's own forward: the check above can fail."""
    inner = backend_named("gemma3")
    unmasked = TransformersBackend(inner.model, tokenizer=inner.tokenizer)
    assert unmasked.sliding is not None
    unmasked.sliding = replace(unmasked.sliding, window=1 << 30)
    window = _window(unmasked)
    assert max(chunk_errors(window).values()) > 1e-3


def test_layers_are_read_from_the_config() -> None:
    assert sliding_layers(LlamaConfig()) is None
    mistral = sliding_layers(MistralConfig(sliding_window=32))
    assert mistral is not None and mistral.window == 32 and not mistral.keyed  # every layer slides
    gemma = sliding_layers(tiny_gemma3().config)
    assert gemma is not None and gemma.keyed  # a mask per layer type


def test_a_kernel_without_custom_masks_is_refused_by_name() -> None:
    model = sharpen(tiny_gemma3(attn_implementation="sdpa"))
    model.config._attn_implementation = "flash_attention_2"  # no custom 4-D mask
    with pytest.raises(UnsupportedModelError, match="attn_implementation='sdpa'"):
        TransformersBackend(model, tokenizer=tiny_tokenizer())


def test_gemma3_vision_models_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedModelError, match="bidirectionally"):
        family_of(Gemma3Config())


def test_an_engine_reads_the_per_layer_rotary_bases_from_the_config_alone() -> None:
    """SGLang's and vLLM's adapters read the layout without the weights: the same bases, per layer."""
    import torch

    from kamera_agent.backends.transformers.reading import kv_layout, kv_layout_of_config

    model = tiny_gemma3(num_hidden_layers=4)
    from_config, from_model = kv_layout_of_config(model.config), kv_layout(model)
    assert from_config.rope.per_layer and from_config.rope.inv_freq.shape == (4, 8)
    assert torch.equal(from_config.rope.inv_freq, from_model.rope.inv_freq)
    assert not torch.equal(from_config.rope.inv_freq[0], from_config.rope.inv_freq[1])  # two bases
