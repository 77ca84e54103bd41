"""One prefill over chunks with placed chunks between them (``starts``, ``sees``) computes what
separate forwards compute, on every engine that supports it (4-layer models)."""

from __future__ import annotations

import pytest
import torch

from kamera_agent.backends.base import Backend
from kamera_agent.errors import LayoutMismatchError
from tests.window.backends import backend_named


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("name", ["qwen2", "qwen2_vl", "tiny_torch"])
def test_a_gapped_run_equals_separate_forwards(name: str) -> None:
    """Window order: anchor, x, p, y, q. p and q are formed in one forward over anchor, x, y
    (placed): p sees anchor and x only, q sees everything (y from the cache, p from the run)."""
    b: Backend = backend_named(name)
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
