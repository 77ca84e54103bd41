"""The token-recompute baseline (`BlendCache`) against the model's own forward (a 4-layer Qwen2-VL:
M-RoPE, an image chunk between text chunks).

Why: the frontier sets the window's settings beside this baseline, so it must be what it says:
recomputing every token is a re-prefill of what changed (logits equal to the model's own
forward), a smaller share costs fewer tokens and moves away from it, the unchanged prefix is
kept for free, and content is prefilled once however often it moves.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.baselines.prefix_cache import PrefixCache
from kamera_agent.bench.blend_cache import BlendCache
from kamera_agent.chunks import Chunk
from kamera_agent.errors import SettingsError
from tests.backends.test_transformers_backend import images, vl_backend


@cache
def _scene() -> tuple[TransformersBackend, list[Chunk], torch.Tensor]:
    backend = vl_backend("qwen2_vl", layers=4)
    encoder = backend.encoder
    chunks = [
        encoder.text("Alice put the red key under the blue mat by the door."),
        encoder.image(images(1, seed=4)[0]),
        encoder.text("Bob moved it to the kitchen drawer later that night, quietly."),
    ]
    return backend, chunks, encoder.query_ids("Where is the key?")


def _truth(backend: TransformersBackend, chunks: list[Chunk], query: torch.Tensor) -> torch.Tensor:
    return backend.reference_prefill(chunks, query).logits.float()


def test_recomputing_every_token_answers_like_the_models_own_forward_after_every_move() -> None:
    backend, (a, image, b), query = _scene()
    blend = BlendCache(backend, fraction=1.0)
    for order in ([a, image, b], [b, image, a], [b, a, image]):
        blend.sync(order)
        logits = blend.first_logits(query).float()
        assert torch.allclose(logits, _truth(backend, order, query), atol=1e-4)


def test_a_share_costs_fewer_tokens_than_all_and_is_not_exact() -> None:
    backend, (a, image, b), query = _scene()
    full, share = BlendCache(backend, fraction=1.0), BlendCache(backend, fraction=0.1)
    for blend in (full, share):
        blend.sync([a, image, b])
    moved = [b, image, a]
    spent_full, spent_share = full.sync(moved), share.sync(moved)
    assert spent_share.tokens < spent_full.tokens
    truth = _truth(backend, moved, query)
    assert (share.first_logits(query).float() - truth).abs().max() > 1e-3


def test_it_never_prefills_more_than_the_prefix_cache_after_its_first_sight_of_the_content() -> None:
    """With every chunk's content seen, a move costs the probe and the selected rows of the
    chunks from the first change: at 100 % exactly the prefix cache's re-prefill (no probe)."""
    backend, (a, image, b), _ = _scene()
    full, prefix = BlendCache(backend, fraction=1.0), PrefixCache(backend)
    for cache_ in (full, prefix):
        cache_.sync([a, image, b])
    assert full.sync([a, b, image]).tokens == prefix.sync([a, b, image]).tokens
    assert full.sync([a, b, image]).tokens == 0  # nothing changed: nothing prefilled, no forward


def test_the_unchanged_prefix_is_kept_and_content_is_prefilled_once() -> None:
    backend, (a, image, b), _ = _scene()
    blend = BlendCache(backend, fraction=0.5)
    first = blend.sync([a, image])
    assert first.vision_runs == 1 and first.reused == 0
    again = blend.sync([a, image, b])
    assert again.reused == backend.anchor.num_tokens + a.num_tokens + image.num_tokens
    assert again.vision_runs == 0
    moved = blend.sync([b, a, image])  # every chunk placed again, none prefilled from scratch
    assert moved.vision_runs == 0 and moved.reused == backend.anchor.num_tokens
    n = a.num_tokens + image.num_tokens + b.num_tokens
    assert moved.tokens < n  # probes (1/4 of a forward each) and half the rows: less than a re-prefill


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, float("nan"), True])
def test_a_fraction_outside_zero_to_one_is_refused_by_name(fraction: float) -> None:
    backend, _, _ = _scene()
    with pytest.raises(SettingsError, match="recompute fraction"):
        BlendCache(backend, fraction=fraction)
