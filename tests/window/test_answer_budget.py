"""The drift budget in answer units (`WindowConfig.answer_budget`): what stands, what is repaired,
what is re-prefilled, and what it costs.

Checked against the model's own re-prefill of the window (`tests.window.helpers`) on a 4-layer
random Qwen2, which needs no calibration for this budget, and on SmolLM2 where an answer must
have a margin to keep.
"""

from __future__ import annotations

import pytest
import torch

from kamera_agent.bench.corpus import QUESTION, passages
from kamera_agent.config import WindowConfig
from kamera_agent.errors import ConfigError
from kamera_agent.fidelity import ANSWER_SHARE, combined, estimate_answer, room, spread
from kamera_agent.window import KameraWindow
from tests.window.backends import backend_named
from tests.window.helpers import answer_kl, budget_ops, check_never_costlier, chunk_errors

EXACT_KV = 2e-5
TEXTS = ["red ball", "green box moves", "a cat sat", "the dog ran", "yellow sun", "blue sky now"]


def _window(answer_budget: float | None, **settings: object) -> KameraWindow:
    config = WindowConfig(capacity_chunks=4, rank=4, answer_budget=answer_budget, **settings)  # type: ignore[arg-type]
    return KameraWindow(backend_named("qwen2"), config=config)


def _filled(window: KameraWindow) -> KameraWindow:
    for text in TEXTS[:4]:
        window.push(text, label=text)
    return window


def test_the_estimate_extrapolates_the_repairs_move() -> None:
    """No move: nothing owed. A move of the served answer's top token: the rest is estimated at
    the move scaled to the rows not recomputed, and a move past the margin changes the top."""
    served = torch.tensor([2.0, 1.0, 0.0])
    assert estimate_answer(served, served, 4.0).kl == 0.0
    small = estimate_answer(served, torch.tensor([1.9, 1.0, 0.0]), 4.0)
    assert small.same_top and small.kl > 0
    assert estimate_answer(served, torch.tensor([1.9, 1.0, 0.0]), 2.0).kl < small.kl
    flipped = estimate_answer(served, torch.tensor([1.5, 1.0, 0.0]), 4.0)  # extrapolated: 0.5 < 1.0
    assert not flipped.same_top
    assert combined(1e-2, 0.0) == pytest.approx(1e-2)
    assert combined(1e-2, 1e-2) == pytest.approx(4e-2)  # square roots add
    assert combined(1e-2, room(4e-2, 1e-2)) == pytest.approx(4e-2) and room(1e-2, 4e-2) == 0.0
    parts = spread(4e-2, [10, 30])  # a verdict spread by tokens: chained, it is the whole again
    assert parts == pytest.approx([2.5e-3, 2.25e-2]) and combined(*parts) == pytest.approx(4e-2)


def test_an_answer_budget_needs_no_calibration_and_is_checked() -> None:
    """Random models have no calibration: a `drift_budget` would run them exactly with a warning
    (an error under the suite's filters); the answer budget runs, and refuses nonsense by name."""
    window = _window(0.05)
    assert window.budget == 0.05 and window.config.survivors == "keep"
    for bad in (0.0, -1.0, float("nan"), 11.0):
        with pytest.raises(ConfigError, match="answer_budget"):
            WindowConfig(answer_budget=bad)


def _real_window(answer_budget: float | None, **settings: object) -> KameraWindow:
    """SmolLM2 over corpus passages: a random model's next token has no margin to keep (its top
    logits tie within what any approximation moves), so what stands is judged on a real one."""
    config = WindowConfig(capacity_chunks=4, answer_budget=answer_budget, **settings)  # type: ignore[arg-type]
    window = KameraWindow(backend_named("smollm2"), config=config)
    for text in passages("calibration", 1, 4):
        window.push(text)
    return window


def test_a_slide_within_the_answer_budget_keeps_its_survivors_with_their_first_rows_repaired() -> None:
    """A loose budget lets a slide's survivors stand: the new lead (the attention sink) is
    re-formed, each other survivor has its first rows recomputed over its left (its state says
    so) and its share of the window's estimate is filed for it (chained, the last survivor's is
    the window's); the op prefills less than re-prefilling the survivors; and the answer is closer
    to the re-prefill's than the unbounded window's."""
    window = _real_window(0.1)
    unbounded = _real_window(None, drift_budget=None)
    survivors = window.refs[1:]
    window.slide(1)
    unbounded.slide(1)
    cost = window.stats.last
    assert cost.drift_fixes == 0 and cost.audits == len(survivors) - 1
    assert window.state_of(survivors[0]).kind == "canonical"
    refill = sum(window.chunk(ref).num_tokens for ref in survivors)
    assert cost.tokens_prefilled - cost.audit_tokens < refill
    repaired = [window.state_of(ref) for ref in survivors[1:]]
    assert all(state.kind == "recomputed" and state.share == ANSWER_SHARE for state in repaired)
    drifts = [window.drift_of(ref) for ref in survivors[1:]]
    assert 0 < cost.drift <= 0.1
    assert drifts == sorted(drifts) and drifts[0] < drifts[-1] == pytest.approx(cost.drift)
    assert max(chunk_errors(window).values()) > EXACT_KV  # the rest of their rows stayed approximate
    assert answer_kl(window, QUESTION[0]) < answer_kl(unbounded, QUESTION[0])


def test_a_tight_answer_budget_re_prefills_and_answers_like_the_model() -> None:
    window = _filled(_window(1e-12))
    window.slide(1)
    assert window.stats.last.drift_fixes > 0
    assert max(chunk_errors(window).values()) <= EXACT_KV
    assert answer_kl(window) < 1e-9
    assert all(window.drift_of(ref) == 0.0 for ref in window.refs)


def test_a_verdict_stands_until_what_it_judged_changes() -> None:
    """A push after a standing slide judges nothing (its chunk is formed exactly over its left
    and the survivors' verdict still holds); an eviction left of them, which changes their
    left, is judged."""
    window = _real_window(0.1)
    window.slide(1)
    assert window.stats.last.drift_fixes == 0
    window.push(passages("calibration", 2, 1)[0])
    assert window.stats.last.audits == 0
    drifts = [window.drift_of(ref) for ref in window.refs]
    window.evict(window.refs[1])
    assert window.stats.last.audits > 0, window.last_plan
    assert max(d for d in drifts if d is not None) <= 0.1  # verdicts chain per op, not per chunk


def test_a_verdict_that_could_not_fit_is_not_paid_for() -> None:
    """Where the verdicts before leave less room than the least estimate an op of its kind has
    measured, the op is re-prefilled from its first unjudged chunk without recomputing rows or
    decoding the probe; the earlier verdict's share stays as it was."""
    window = _real_window(0.1)
    window.slide(1)
    assert window.stats.last.drift_fixes == 0
    window.push(passages("calibration", 2, 1)[0])
    budget = window._parts.budget
    assert budget is not None and 0 < budget.least("evict") <= 0.1
    kept = window.drift_of(window.refs[1])
    assert kept is not None and 0 < kept < window.stats.last.drift
    budget._least["slide"] = (4, room(0.1, kept) * 1.01)  # what four worse verdicts would have taught
    window.evict(window.refs[2])  # the pushed chunk's left changes: it is judged over a kept share
    cost = window.stats.last
    assert cost.audits == 0 and cost.audit_tokens == 0 and cost.drift_fixes > 0
    assert "under the least" in str(window.last_plan)
    assert window.drift_of(window.refs[1]) == kept and window.drift_of(window.refs[-1]) == kept
    assert max(chunk_errors(window).values()) > EXACT_KV  # the kept survivor's rest is approximate


@pytest.mark.parametrize("budget", [1e-12, 5.0])
def test_an_answer_budget_never_prefills_more_than_a_prefix_cache(budget: float) -> None:
    """Each op's prefilled tokens, apart from the estimator's (the rows it recomputes and the
    probe it decodes, counted in ``audit_tokens``), stay within re-prefilling from the first slot
    whose content changed."""
    window = _window(budget)
    for op in budget_ops(TEXTS):
        check_never_costlier(window, op)
        if budget < 1e-9:
            assert answer_kl(window) < 1e-9
