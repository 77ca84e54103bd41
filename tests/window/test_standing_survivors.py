"""A chunk evicted from the middle, its survivors kept with what they absorbed, recalled at the end.

Survivors that kept their KV (``survivors="keep"``, under a drift budget) still encode the
evicted chunk; recalled at the end, it stands to their right. Their KV and their left context
are what they were, what the budget already vouched for while the chunk was away: they stand as
they are, judged by the budget as any kept state, and the recall pays no more than a prefix
cache (re-prefilling from the first slot whose content changed: the recalled chunk alone).
Re-forming them from the first one on paid many times that. On a 4-layer random Qwen2
(transformers), whose calibration the test files itself; under the exact settings nothing
changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kamera_agent.config import WindowConfig
from kamera_agent.core.identity import ChunkState
from kamera_agent.fidelity import CALIBRATION_DIR_VARIABLE
from kamera_agent.window import ChunkRef, KameraWindow
from tests.kv_helpers import next_token_kl
from tests.window.backends import backend_named
from tests.window.helpers import answer_kl, calibrate_for_tests, chunk_errors, right_to_left_edges
from tests.window.oracle import StateOracle

EXACT_KV = 2e-5
EPSILON = 0.3  # wide enough on this random model for the budget to keep the survivors at eviction
NOTES = [
    "the first note says red ball rolls",
    "green box moves to the left side",
    "a cat sat on the warm mat today",
    "the dog ran far into the park",
    "yellow sun rose over blue hills",
    "blue sky now and clouds later",
]


@pytest.fixture
def calibrations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CALIBRATION_DIR_VARIABLE, str(tmp_path))
    calibrate_for_tests(backend_named("qwen2").fingerprint, tmp_path)
    return tmp_path


def _window(config: WindowConfig) -> KameraWindow:
    return KameraWindow(backend_named("qwen2"), config=config)


def _evict_middle(window: KameraWindow) -> tuple[ChunkRef, dict[ChunkRef, ChunkState]]:
    """The notes pushed, the third evicted; it and each chunk's state after the eviction."""
    for note in NOTES:
        window.push(note, label=note[:8])
    middle = window.refs[2]
    window.evict(middle)
    return middle, {ref: window.state_of(ref) for ref in window.refs}


def _prefix_cache_tokens(window: KameraWindow, before: list[str]) -> int:
    """What re-prefilling from the first slot whose content changed costs (counted by content key,
    independently of the planner)."""
    after = [window.chunk(ref) for ref in window.refs]
    same = next((k for k, (a, b) in enumerate(zip(before, after, strict=False)) if a != b.key), len(before))
    return sum(chunk.num_tokens for chunk in after[same:])


def _recall_at_the_end(window: KameraWindow, middle: ChunkRef) -> int:
    """Recall ``middle`` at the end; what a prefix cache pays for that op."""
    before = [window.chunk(ref).key for ref in window.refs]
    window.recall(middle)
    assert window.refs[-1] == middle
    return _prefix_cache_tokens(window, before)


def test_survivors_that_absorbed_the_recalled_chunk_stand_and_the_recall_costs_a_prefix_caches(
    calibrations: Path,
) -> None:
    window = _window(WindowConfig(capacity_chunks=8, rank=4, drift_budget=EPSILON))
    middle, kept = _evict_middle(window)
    absorbed = [ref for ref in window.refs[2:] if middle in window.graph.pred[ref]]
    assert absorbed, "the budget re-prefilled the survivors at eviction: this test could not fail"
    prefix = _recall_at_the_end(window, middle)
    cost = window.stats.last
    assert cost.tokens_prefilled - cost.audit_tokens <= prefix == window.chunk(middle).num_tokens
    assert all(window.state_of(ref) == kept[ref] for ref in absorbed)  # they stood as they were
    assert set(right_to_left_edges(window)) == {(middle, ref) for ref in absorbed}
    for ref in window.refs:  # the budget's verdict holds for them as for any kept state
        drift = window.drift_of(ref)
        assert drift is not None and drift <= EPSILON, (ref, drift)
    assert cost.drift <= EPSILON
    oracle = StateOracle(window.backend)  # every KV is what its state names, built apart
    for ref in (*window.refs, *window.evicted):
        oracle.know(window.chunk(ref))
    assert all(error <= EXACT_KV for error, _ in oracle.errors(window).values())


def test_a_standing_survivor_the_budget_finds_over_it_is_re_prefilled_within_the_prefix_bound(
    calibrations: Path,
) -> None:
    """The budget's verdict, not the stand, decides: a survivor whose remembered audit is over ε
    is fixed (the cheapest fix that holds: here re-prefilled alone over its left, the chunks after
    it audited again behind it), and the op still pays no more than re-prefilling from it."""
    window = _window(WindowConfig(capacity_chunks=8, rank=4, drift_budget=EPSILON))
    middle, kept = _evict_middle(window)
    survivor = next(ref for ref in window.refs[2:] if middle in window.graph.pred[ref])
    slot = window.refs.index(survivor)
    left = window._parts.core.root
    for ref in window.refs[:slot]:
        left = left.extend(window.state_of(ref))
    budget = window._parts.budget
    assert budget is not None
    budget.remember(kept[survivor], left, 2 * EPSILON)  # as if its audit had found it over
    _recall_at_the_end(window, middle)
    cost = window.stats.last
    from_it = sum(window.chunk(ref).num_tokens for ref in window.refs[slot:])
    assert cost.tokens_prefilled - cost.audit_tokens <= from_it
    assert window.state_of(survivor) != kept[survivor] and window.drift_of(survivor) == 0.0
    assert all(window.state_of(ref) == kept[ref] for ref in window.refs[:slot])
    assert survivor not in {target for _, target in right_to_left_edges(window)}
    for ref in window.refs:
        drift = window.drift_of(ref)
        assert drift is not None and drift <= EPSILON, (ref, drift)


def test_under_the_exact_settings_the_recall_is_exact_and_costs_a_prefix_caches() -> None:
    window = _window(WindowConfig.exact(capacity_chunks=8))
    middle, _ = _evict_middle(window)
    assert not any(middle in window.graph.pred[ref] for ref in window.refs)  # re-formed without it
    prefix = _recall_at_the_end(window, middle)
    cost = window.stats.last
    assert cost.tokens_prefilled - cost.audit_tokens <= prefix
    assert max(chunk_errors(window).values()) <= EXACT_KV
    assert answer_kl(window) < 1e-9
    assert right_to_left_edges(window) == []


def test_probing_the_recalled_chunk_takes_it_off_the_survivors_that_stood(calibrations: Path) -> None:
    """They still encode it: a probe without it serves them without that conditioning too, so the
    view it decodes is the re-prefill of the window without it (every other chunk here is exact,
    and the stood ones have no reduced state stored: they are formed exactly over what is left)."""
    window = _window(WindowConfig(capacity_chunks=8, rank=4, drift_budget=EPSILON))
    middle, _ = _evict_middle(window)
    _recall_at_the_end(window, middle)
    assert right_to_left_edges(window)
    query = "What is it?"
    probe = window.probe_without(middle, query, max_new_tokens=1)
    rest = [window.chunk(ref) for ref in window.refs if ref != middle]
    query_ids = window.encoder.query_ids(query)
    truth = window.backend.reference_prefill(rest, query_ids, anchor=window.encoder.anchor()).logits
    assert next_token_kl(truth, probe.without_chunk.first_logits) < 1e-9


def test_a_later_reorder_leaves_the_survivors_that_stood_as_they_are(calibrations: Path) -> None:
    """Their edges from the recalled chunk already pointed right before the reorder: one that
    leaves their left context alone (the recalled chunk and a later one swapped) leaves them
    alone, and pays a prefix cache's tokens."""
    window = _window(WindowConfig(capacity_chunks=8, rank=4, drift_budget=EPSILON))
    middle, _ = _evict_middle(window)
    _recall_at_the_end(window, middle)
    window.push("a note pushed after the recall")
    stood = {target for _, target in right_to_left_edges(window)}
    order = list(window.refs)
    last = len(order) - 1
    assert all(window.refs.index(ref) < last - 1 for ref in stood)  # left of the two swapped
    kept = {ref: window.state_of(ref) for ref in order}
    before = [window.chunk(ref).key for ref in order]
    order[last - 1], order[last] = order[last], order[last - 1]
    window.reorder(order)
    cost = window.stats.last
    assert cost.tokens_prefilled - cost.audit_tokens <= _prefix_cache_tokens(window, before)
    assert all(window.state_of(ref) == kept[ref] for ref in stood)
