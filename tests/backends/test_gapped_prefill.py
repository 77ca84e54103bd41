"""One prefill over chunks with placed chunks between them (``starts``, ``sees``) computes what
separate forwards compute, on every engine that supports it (4-layer models)."""

from __future__ import annotations

import pytest
import torch

from kamera_agent.backends.base import Backend
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.errors import LayoutMismatchError
from kamera_agent.models.random_qwen2 import Qwen2Shape, random_qwen2
from kamera_agent.models.tiny_tokenizer import build_byte_tokenizer
from tests.window.backends import backend_named

SDPA_SHAPE = Qwen2Shape(layers=4, hidden=64, heads=4, kv_heads=2, mlp=128, vocab=512)


def _backend(name: str) -> Backend:
    if name == "qwen2_sdpa":  # the realistic bench shape's attention implementation
        model = random_qwen2(SDPA_SHAPE, seed=3, attention="sdpa")
        return TransformersBackend(model, tokenizer=build_byte_tokenizer(vocab_size=SDPA_SHAPE.vocab))
    return backend_named(name)


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("name", ["qwen2", "qwen2_sdpa", "qwen2_vl", "tiny_torch", "gemma3"])
def test_a_gapped_run_equals_separate_forwards(name: str) -> None:
    """Window order: anchor, x, p, y, q. p and q are formed in one forward over anchor, x, y
    (placed): p sees anchor and x only, q sees everything (y from the cache, p from the run)."""
    b = _backend(name)
    assert b.supports_gaps
    enc = b.encoder
    anchor = enc.anchor()
    x, p, y, q = (enc.text(t) for t in ("a red ball", "a caption here", "then it rolled", "and what now"))
    start_x = anchor.advance
    start_p = start_x + x.advance
    start_y = start_p + p.advance
    start_q = start_y + y.advance
    anchor_kv = b.prefill([anchor], [], 0).kv[0]
    x_kv = b.prefill([x], [anchor_kv], start_x).kv[0]
    p_ref = b.prefill([p], [anchor_kv, x_kv], start_p).kv[0]
    y_kv = b.prefill([y], [anchor_kv, x_kv, p_ref], start_y).kv[0]
    q_ref = b.prefill([q], [anchor_kv, x_kv, p_ref, y_kv], start_q).kv[0]

    sees_p = anchor.num_tokens + x.num_tokens
    sees_q = sees_p + y.num_tokens
    done = b.prefill([p, q], [anchor_kv, x_kv, y_kv], 0, starts=[start_p, start_q], sees=[sees_p, sees_q])
    p_kv, q_kv = done.kv
    assert torch.equal(p_kv.positions, p_ref.positions) and torch.equal(q_kv.positions, q_ref.positions)
    for got, want in ((p_kv, p_ref), (q_kv, q_ref)):
        assert _max_error(got.keys, want.keys) < 1e-4 and _max_error(got.values, want.values) < 1e-4
    # The mask matters: p seeing y too gives other KV (the test can fail).
    leaky = b.prefill([p, q], [anchor_kv, x_kv, y_kv], 0, starts=[start_p, start_q], sees=[sees_q, sees_q])
    assert _max_error(leaky.kv[0].keys, p_ref.keys) > 1e-3


def test_sees_must_lie_within_the_cached_slots() -> None:
    b = backend_named("tiny_torch")
    enc = b.encoder
    anchor = enc.anchor()
    anchor_kv = b.prefill([anchor], [], 0).kv[0]
    chunk = enc.text("some words")
    with pytest.raises(LayoutMismatchError, match="sees"):
        b.prefill([chunk], [anchor_kv], anchor.advance, sees=[anchor.num_tokens + 1])
    with pytest.raises(LayoutMismatchError, match="starts"):
        b.prefill([chunk], [anchor_kv], anchor.advance, starts=[1, 2])


def test_flash_style_attention_runs_no_gapped_prefill() -> None:
    """Kernels that take no custom 4-D mask would ignore it: such a model reports no gaps."""
    model = random_qwen2(SDPA_SHAPE, seed=3, attention="sdpa")
    model.config._attn_implementation = "flash_attention_2"
    backend = TransformersBackend(model, tokenizer=build_byte_tokenizer(vocab_size=SDPA_SHAPE.vocab))
    assert not backend.supports_gaps
    model.config._attn_implementation = "eager"
    assert TransformersBackend(
        model, tokenizer=build_byte_tokenizer(vocab_size=SDPA_SHAPE.vocab)
    ).supports_gaps
