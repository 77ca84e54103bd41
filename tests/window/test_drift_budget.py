"""The drift budget: what a window estimates, keeps within ε, and what it does without a calibration.

Checked against the model's own re-prefill of the window (`tests.window.helpers`) on a 4-layer
random Qwen2 whose calibration the test files itself (random models have none), and on the
shipped demo model with its shipped calibration.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest

from kamera_agent.backends.base import Spent
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.config import WindowConfig
from kamera_agent.core.costs import CostMeter
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.core.kv_core import Txn
from kamera_agent.core.staging import StagedStore
from kamera_agent.errors import ConfigError, UncalibratedWarning, UnknownChunkError
from kamera_agent.fidelity import (
    CALIBRATION_DIR_VARIABLE,
    Calibration,
    audit_indices,
    find_calibration,
    relative_error,
    save_calibration,
)
from kamera_agent.operator.layout import to_position_free
from kamera_agent.results import OpCost
from kamera_agent.store import DriftAudit
from kamera_agent.window import KameraWindow
from kamera_agent.window import drift_fixes as drift_fixes_module
from kamera_agent.window.executor import Executor
from tests.kv_helpers import rel_err
from tests.window.backends import backend_named
from tests.window.helpers import (
    answer_kl,
    budget_ops,
    calibrate_for_tests,
    check_never_costlier,
    chunk_errors,
    chunk_errors_in_order,
    right_to_left_edges,
)
from tests.window.oracle import StateOracle

EXACT_KV = 2e-5
TEXTS = ["red ball", "green box moves", "a cat sat", "the dog ran", "yellow sun", "blue sky now"]


@pytest.fixture
def calibrations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CALIBRATION_DIR_VARIABLE, str(tmp_path))
    return tmp_path


def _window(epsilon: float | str | None, **settings: object) -> KameraWindow:
    config = WindowConfig(capacity_chunks=4, rank=4, drift_budget=epsilon, **settings)  # type: ignore[arg-type]
    return KameraWindow(backend_named("qwen2"), config=config)


def _episode(window: KameraWindow) -> list[str]:
    """Pushes, slides (survivors keep what left), a reorder and a recall: every approximation the
    defaults make; each op's name, for messages."""
    ops = []
    for text in TEXTS[:4]:
        window.push(text, label=text)
        ops.append("push")
    window.slide(1)
    ops.append("slide")
    window.push(TEXTS[4], label=TEXTS[4])
    ops.append("push")
    window.reorder(list(reversed(window.refs)))
    ops.append("reorder")
    window.evict(window.refs[1])
    ops.append("evict")
    window.recall(window.evicted[0], at=0)
    ops.append("recall")
    return ops


def test_a_budget_of_zero_is_exact_and_needs_no_calibration() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no UncalibratedWarning: exactness needs no calibration
        window = _window(0.0)
    assert window.config.survivors == "removal" and window.config.rank == "full"
    assert window.budget == 0.0
    _episode(window)
    assert max(chunk_errors(window).values()) <= EXACT_KV
    assert all(window.drift_of(ref) == 0.0 for ref in window.refs)


def test_an_uncalibrated_model_runs_exactly_with_one_warning(
    calibrations: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # Python's: each warning once per call site
        window = _window("calibrated")
        _window(0.05)
    uncalibrated = [w for w in seen if issubclass(w.category, UncalibratedWarning)]
    assert len(uncalibrated) == 1 and "kamera calibrate" in str(uncalibrated[0].message)
    assert window.budget == 0.0 and window.config.survivors == "removal"  # ran exactly
    _episode(window)
    assert max(chunk_errors(window).values()) <= EXACT_KV


@pytest.mark.parametrize("setting", [{"reorder": "revert"}, {"reorder": "keep"}, {"patch_mode": "none"}])
def test_running_exactly_overrides_every_approximating_policy(
    calibrations: Path, setting: dict[str, str]
) -> None:
    """A window that runs exactly (its model uncalibrated) does, whatever approximating policy
    its settings named: a reorder that would revert to canonicals forms them over their new left."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncalibratedWarning)
        window = _window(0.05, **setting)
    assert window.budget == 0.0
    for text in TEXTS[:4]:
        window.push(text, label=text)
    window.reorder(list(reversed(window.refs)))
    assert max(chunk_errors(window).values()) <= EXACT_KV
    assert answer_kl(window) < 1e-9


def test_another_models_calibration_is_never_used(calibrations: Path) -> None:
    fingerprint = backend_named("qwen2").fingerprint
    save_calibration(Calibration("0" * 64, scale=1.0), calibrations)
    assert find_calibration(fingerprint) is None
    calibrate_for_tests(fingerprint, calibrations)
    found = find_calibration(fingerprint)
    assert found is not None and found.fingerprint == fingerprint
    (calibrations / f"{fingerprint[:32]}.json").write_text("{not json")
    assert find_calibration(fingerprint) is None  # unreadable: as if absent


@pytest.mark.parametrize("epsilon", [1e-9, 0.05])
def test_the_budget_is_kept_after_every_op(calibrations: Path, epsilon: float) -> None:
    """After every op each chunk's estimate is within ε; a chunk estimated 0 is exact; a tiny ε
    answers like a re-prefill; and every audit and fix is counted."""
    calibrate_for_tests(backend_named("qwen2").fingerprint, calibrations)
    window = _window(epsilon)
    assert window.budget == epsilon and window.config.survivors == "keep"  # the policies stay
    for text in TEXTS[:4]:
        window.push(text, label=text)
    checks = [lambda w: w.slide(1), lambda w: w.reorder(list(reversed(w.refs))), lambda w: w.evict(w.refs[1])]
    checks.append(lambda w: w.recall(w.evicted[0], at=0))
    for op in checks:
        op(window)
        errors = chunk_errors_in_order(window)
        for ref, error in zip(window.refs, errors, strict=True):
            drift = window.drift_of(ref)
            assert drift is not None and drift <= epsilon, (ref, drift)
            if drift == 0.0:
                assert error <= EXACT_KV, (ref, errors)
        assert window.stats.last.drift <= epsilon
    total = window.stats.total
    assert total.audits > 0 and total.audit_tokens >= 2 * total.audits
    if epsilon < 1e-6:
        assert total.drift_fixes > 0  # the unbounded policies' approximations were fixed
        assert max(chunk_errors(window).values()) <= EXACT_KV
        assert answer_kl(window) < 1e-9


def test_without_a_budget_the_policies_are_unbounded_and_unestimated(calibrations: Path) -> None:
    calibrate_for_tests(backend_named("qwen2").fingerprint, calibrations)
    window = _window(None)
    assert window.budget is None
    _episode(window)
    drifts = [window.drift_of(ref) for ref in window.refs]
    assert None in drifts  # approximated chunks: not estimated without a budget
    assert window.stats.total.audits == 0 and window.stats.total.drift_fixes == 0
    assert max(chunk_errors(window).values()) > 1e-3  # the policies did approximate here


def test_a_budget_never_prefills_more_than_a_prefix_cache(calibrations: Path) -> None:
    """Each op's prefilled tokens, its audits' apart, stay within re-prefilling from the first slot
    whose content changed (the test counts that slot itself, from chunk keys)."""
    calibrate_for_tests(backend_named("qwen2").fingerprint, calibrations)
    window = _window(0.05)
    for op in budget_ops(TEXTS):
        check_never_costlier(window, op)


def test_ops_whose_approximations_keep_failing_stop_being_tried(calibrations: Path) -> None:
    """At a budget no approximation of this model meets, slides stop keeping survivors after the
    first fails (one audited slide, then re-prefills), so audits do not pile up."""
    calibrate_for_tests(backend_named("qwen2").fingerprint, calibrations)
    window = _window(1e-9)
    for text in TEXTS:
        window.push(text)
    audited = []
    for text in TEXTS * 2:
        window.slide(1)
        audited.append(window.stats.last.audits)
        window.push(text)
    assert audited[0] > 0 and sum(a > 0 for a in audited) <= 2, audited


def test_drift_of_names_what_it_cannot_estimate(calibrations: Path) -> None:
    calibrate_for_tests(backend_named("qwen2").fingerprint, calibrations)
    window = _window(0.05)
    first = window.push("red ball")
    window.push("green box")
    window.evict(first)
    with pytest.raises(UnknownChunkError, match="evicted"):
        window.drift_of(first)


def test_budget_settings_are_checked() -> None:
    for bad in (-0.1, math.nan, math.inf, "tight", True):
        with pytest.raises(ConfigError, match="drift_budget"):
            WindowConfig(drift_budget=bad)  # type: ignore[arg-type]
    assert WindowConfig.exact().drift_budget == 0.0
    assert WindowConfig().drift_budget == "calibrated"


def test_summed_costs_keep_the_largest_drift() -> None:
    total = OpCost(drift=0.02, audits=1) + OpCost(drift=0.01, audits=2)
    assert total.drift == 0.02 and total.audits == 3


def test_an_audit_draws_the_same_rows_for_the_same_pair() -> None:
    a, b = audit_indices(50, 0.1, "s:c"), audit_indices(50, 0.1, "s:c")
    assert a.tolist() == b.tolist() and len(a) == 5 and a.tolist() == sorted(set(a.tolist()))
    assert audit_indices(50, 0.1, "s:d").tolist() != a.tolist()
    assert len(audit_indices(3, 0.1, "x")) == 2 and len(audit_indices(1, 0.5, "x")) == 1


def test_the_shipped_calibration_is_the_demo_models() -> None:
    """Retraining the demo model changes its fingerprint: its shipped calibration must be refitted
    (``kamera calibrate demo --out kamera_agent/models/calibrations``), else it runs exactly."""
    from kamera_agent.demo.model import load_demo_model

    model, tokenizer, image_processor = load_demo_model()
    window = KameraWindow(model, tokenizer=tokenizer, image_processor=image_processor)
    calibration = find_calibration(window.backend.fingerprint)
    assert calibration is not None and window.budget == calibration.budget
    assert calibration.seeds and not set(calibration.seeds) & {424242, 424243}  # not the suite's episodes


def test_windows_on_one_store_share_what_the_budget_learned(calibrations: Path) -> None:
    """A second window on the same store (a new serve session) does not audit again what the
    first found over ε: its first slide is re-prefilled without trying. A window on a store of
    its own learns for itself."""
    calibrate_for_tests(backend_named("qwen2").fingerprint, calibrations)
    first = _window(1e-9)
    for text in TEXTS:
        first.push(text)
    first.slide(1)
    first.push(TEXTS[0])
    first.slide(1)
    assert first.stats.total.audits > 0
    config = WindowConfig(capacity_chunks=4, rank=4, drift_budget=1e-9)
    second = KameraWindow(backend_named("qwen2"), config=config, store=first.store)
    for text in reversed(TEXTS):  # another arrangement: nothing the first filed fits it exactly
        second.push(text)
    second.slide(1)
    assert second.stats.last.audits == 0 and "drift budget expects" in str(second.last_plan)
    assert second._parts.budget is first._parts.budget
    alone = _window(1e-9)
    assert alone._parts.budget is not first._parts.budget  # another store: its own
    other = KameraWindow(
        backend_named("qwen2"), config=config.model_copy(update={"drift_budget": 0.05}), store=first.store
    )
    assert other._parts.budget is not first._parts.budget  # another ε: its own


def test_a_calibrations_fix_shares_are_where_a_new_window_starts(calibrations: Path) -> None:
    """Where the calibration's run found slides' fixes spending nearly their whole bound, a new
    window re-prefills its first slide without an audit; where they spent little, it tries; the
    window's own outcomes outweigh the calibration's (its counts are capped)."""
    fingerprint = backend_named("qwen2").fingerprint
    for shares, tried in (((40, 38.0), False), ((40, 1.0), True)):
        calibrate_for_tests(fingerprint, calibrations, fix_shares={"slide": shares})
        assert find_calibration(fingerprint).fix_shares == {"slide": shares}  # type: ignore[union-attr]
        window = _window(1e-9)
        for text in TEXTS:
            window.push(text)
        window.slide(1)
        assert (window.stats.last.audits > 0) == tried, window.last_plan
        assert ("drift budget expects" in str(window.last_plan)) != tried
        budget = window._parts.budget
        assert budget is not None
        audited, spent = budget.outcomes()["slide"]
        prior = shares[1] * 8 / 40
        assert audited == 8 + tried
        assert spent > prior if tried else spent == prior  # at 1e-9 its fixes spent some of the bound


def test_audits_are_filed_in_the_store_for_every_reader(calibrations: Path, tmp_path: Path) -> None:
    """An audit is filed with the op's writes: a window of another process over the same disk
    store (its own budget, remembering nothing) reads it instead of auditing the same chunk
    states again, and estimates the same drift."""
    calibrate_for_tests(backend_named("qwen2").fingerprint, calibrations)
    settings = {"disk_dir": tmp_path / "store", "disk_limit": 1 << 26}
    first = _window(0.05, **settings)
    for text in TEXTS[:4]:
        first.push(text, label=text)
    first.slide(1)
    assert first.stats.last.audits > 0
    drifts = [first.drift_of(ref) for ref in first.refs]
    keys = [key for key in first.store.keys() if key.kind == "audit"]  # noqa: SIM118 (the local tiers' keys)
    assert len(keys) == first.stats.total.audits  # one entry per audit, none for exact chunks
    first.close()

    second = _window(0.05, **settings)
    for text in TEXTS[:4]:
        second.push(text, label=text)
    second.slide(1)
    assert second.stats.total.audits == 0
    assert [second.drift_of(ref) for ref in second.refs] == drifts


def test_a_failed_op_files_no_audit(calibrations: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Audits go with the op's other writes: an op that fails after auditing leaves the store as
    it was (no audit of a state the window never held)."""
    calibrate_for_tests(backend_named("qwen2").fingerprint, calibrations)
    staged: list[object] = []
    put_audit = StagedStore.put_audit

    def counted(self: StagedStore, audit: DriftAudit) -> None:
        staged.append(audit)
        put_audit(self, audit)

    monkeypatch.setattr(StagedStore, "put_audit", counted)
    window = _window(0.05)
    for text in TEXTS[:4]:
        window.push(text, label=text)
    before = set(window.store.keys())
    original = drift_fixes_module.DriftFixes.run

    def fails_after_auditing(self: drift_fixes_module.DriftFixes, plan: object) -> object:
        original(self, plan)  # type: ignore[arg-type]
        raise RuntimeError("the op fails after its audits")

    monkeypatch.setattr(drift_fixes_module.DriftFixes, "run", fails_after_auditing)
    with pytest.raises(RuntimeError):
        window.slide(1)
    monkeypatch.setattr(drift_fixes_module.DriftFixes, "run", original)
    assert staged  # the op audited before it failed
    assert set(window.store.keys()) == before


NOTES = [
    "the red ball rolled",
    "green box " * 3,
    " ".join(["a long note about the morning walk and the dog"] * 4),
    "the dog ran after the kite in the rain today",
]


def _evict_behind_a_vouched_chunk(epsilon: float | None, share: float, calibrations: Path) -> KameraWindow:
    """Four notes; the chunk that will follow the evicted one vouched for (an audit of 0 remembered
    for it behind its new left context), then the second note evicted. The last note, kept with
    what it absorbed from the evicted one, is the first chunk over ε, and the vouched chunk between
    the op's first changed slot and it leaves the never-costlier rule room for a recompute."""
    calibrate_for_tests(
        backend_named("qwen2").fingerprint, calibrations, audit_share=0.1, recompute_share=share
    )
    window = _window(epsilon)
    for note in NOTES:
        window.push(note, label=note[:8])
    first, evicted, vouched, _ = window.refs
    budget = window._parts.budget
    if budget is not None:
        budget.always_try = True
        left = window._parts.core.root.extend(window.state_of(first))
        budget.remember(window.state_of(vouched), left, 0.0)
    window.evict(evicted)
    return window


def test_an_over_budget_chunk_is_fixed_by_recomputing_its_most_deviating_tokens(calibrations: Path) -> None:
    """The budget's cheapest fix: the chunk's most deviating 30 % of tokens recomputed over the
    chunks to its left. Its KV is a state of its own (never exact), nearer the chunk's own forward
    over those chunks than the kept state it came from, made again alike from what its state
    names, estimated within ε; the op prefilled far fewer tokens than re-prefilling from its
    first changed slot."""
    window = _evict_behind_a_vouched_chunk(0.08, 0.3, calibrations)
    cost, last = window.stats.last, window.refs[-1]
    assert cost.drift_recomputes == 1 and cost.drift_fixes == 0, window.last_plan
    state = window.state_of(last)
    assert state.kind == "recomputed" and not state.exact and state.share == 0.3
    assert state.source is not None and state.source.kind == "patched"
    assert "30% of tokens recomputed (approximate)" in repr(state)
    drift = window.drift_of(last)
    assert drift is not None and 0 < drift <= 0.08
    chunk = window.chunk(last)
    selected = math.ceil(0.3 * chunk.num_tokens)
    prefix = sum(window.chunk(ref).num_tokens for ref in window.refs[1:])  # from the changed slot
    assert cost.tokens_prefilled - cost.audit_tokens == selected + math.ceil(chunk.num_tokens / 4) < prefix

    runner, core = window._runner, window._parts.core
    with runner.lock:  # against the chunk's own forward over the chunks to its left as they are
        meter = CostMeter()
        txn = Txn(StagedStore(window.store), meter)
        executor = Executor(runner.state, core, txn, window.config)
        placed, start = executor.placements(), core.anchor.advance
        start += sum(window.chunk(ref).advance for ref in window.refs[:-1])
        truth = core.condition([chunk], placed[:-1], start, txn).kv[0]
        source = core.place(*executor.position_free_parts(state.source), chunk.positions_at(start))
        meter.spent = Spent()
        rebuilt = executor._recomputed_over(chunk, state)  # what the state names, made again
    recomputed, kept = relative_error(placed[-1], truth), relative_error(source, truth)
    assert recomputed < 0.8 * kept, (recomputed, kept)
    oracle = StateOracle(window.backend)  # every chunk against what its state names, built apart
    for ref in (*window.refs, *window.evicted):
        oracle.know(window.chunk(ref))
    assert all(error <= EXACT_KV for error, _ in oracle.errors(window).values())
    held = window._runner.state.entries[last].full
    assert held is not None and meter.spent.forwards == 2  # the probe and the recompute
    free = to_position_free(rebuilt, window.backend.layout)
    assert rel_err(free.keys, held.keys) < EXACT_KV and rel_err(free.values, held.values) < EXACT_KV


def test_a_recomputed_chunk_still_encodes_what_its_source_did(calibrations: Path) -> None:
    """Its kept tokens still carry the evicted chunk: the graph says so across later ops, so
    recalling that chunk to its right leaves it standing as it is (its left unchanged, the
    budget's verdict on it as before), its edge naming the state the chunk had when absorbed."""
    window = _evict_behind_a_vouched_chunk(0.08, 0.3, calibrations)
    last, (evicted,) = window.refs[-1], window.evicted
    state = window.state_of(last)
    assert state.kind == "recomputed" and evicted in window.graph.pred[last]
    note = window.push("a short note")  # its left unchanged: it keeps its state and its edges
    assert window.state_of(last) == state and evicted in window.graph.pred[last]
    window.evict(note)
    window.recall(evicted)  # behind it
    order = {ref: i for i, ref in enumerate(window.refs)}
    assert order[evicted] > order[last] and window.state_of(last) == state
    assert (evicted, last) in right_to_left_edges(window)
    drift = window.drift_of(last)
    assert drift is not None and drift <= 0.08
    cost = window.stats.last
    assert cost.tokens_prefilled - cost.audit_tokens <= window.chunk(evicted).num_tokens


def test_a_recompute_that_leaves_its_chunk_over_budget_is_followed_by_the_re_prefill(
    calibrations: Path,
) -> None:
    """Where the recompute does not bring the chunk within ε, the chunk and what follows are
    re-prefilled as before (exact), the op still within the prefix cache's cost, and the budget
    remembers how recomputes fare."""
    window = _evict_behind_a_vouched_chunk(1e-3, 0.3, calibrations)
    cost = window.stats.last
    assert cost.drift_recomputes == 1 and cost.drift_fixes == 1
    state, left = window.state_of(window.refs[-1]), window._parts.core.root
    for ref in window.refs[:-1]:
        left = left.extend(window.state_of(ref))
    # formed over the chunks to its left as they are (the vouched one is the test's fiction)
    assert state.kind == "patched" and state.rank == "full" and state.context == left
    assert window.drift_of(window.refs[-1]) == 0.0
    prefix = sum(window.chunk(ref).num_tokens for ref in window.refs[1:])
    assert cost.tokens_prefilled - cost.audit_tokens <= prefix
    budget = window._parts.budget
    assert budget is not None and budget.outcomes()["recompute"] == (1, 1)


def test_a_recompute_is_never_tried_where_its_failure_would_cost_more_than_a_prefix_cache(
    calibrations: Path,
) -> None:
    """When the first chunk over ε sits at the op's first changed slot, a recompute that failed
    would add its tokens to a re-prefill from that slot: the budget re-prefills at once."""
    window = _evict_behind_a_vouched_chunk(1e-3, 0.3, calibrations)
    window.evict(window.refs[1])  # nothing vouched now: the chunk after it is the first over
    assert window.stats.last.drift_fixes > 0 and window.stats.last.drift_recomputes == 0


def test_a_chunk_over_budget_is_re_prefilled_alone_and_the_chunks_after_it_are_kept(
    calibrations: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a slide the first survivor behind the new lead is over ε and the one after it is
    not (audits scripted by chunk: the model's own errors are the benchmark's to measure): the
    budget forms only that survivor over its left and keeps the next one as it is, where the
    re-prefill from it would have formed both; what it learned is counted under its own name."""
    calibrate_for_tests(
        backend_named("qwen2").fingerprint, calibrations, audit_share=0.1, inherit=0.0, recompute_share=1.0
    )
    scripted = {"note-c": 0.5}

    def audit(core: object, chunk: Chunk, *rest: object) -> tuple[float, int]:
        return scripted.get(chunk.label or "", 0.01), 2

    monkeypatch.setattr(drift_fixes_module, "audit", audit)
    window = _window(0.05)
    for name, note in zip("abcd", NOTES, strict=True):
        window.push(note, label=f"note-{name}")
    kept = window.refs[-1]
    window.slide(1)
    cost = window.stats.last
    lead, formed, after = window.refs
    assert cost.drift_fixes == 1 and cost.drift_recomputes == 0, window.last_plan
    left = window._parts.core.root.extend(window.state_of(lead))
    state = window.state_of(formed)
    assert state.kind == "patched" and state.rank == "full" and state.context == left
    assert after == kept and window.state_of(after).context != left.extend(state)  # kept as it was
    drift = window.drift_of(after)
    assert drift is not None and 0 < drift <= 0.05
    prefilled = cost.tokens_prefilled  # the scripted audits run no forward
    assert prefilled == window.chunk(formed).num_tokens  # the lead's canonical is stored already
    assert prefilled < sum(window.chunk(ref).num_tokens for ref in window.refs)  # a prefix cache's
    budget = window._parts.budget
    assert budget is not None and budget.outcomes()["refill_one"] == (1, 0)


def test_a_recomputed_state_is_named_by_its_source_context_and_share() -> None:
    root = Context.root("anchor")
    left = root.extend(ChunkState.canonical("a", root))
    source = ChunkState.patched("b", "full", root.extend(ChunkState.canonical("c", root)))
    state = ChunkState.recomputed(source, left, 0.15)
    assert state.is_full and not state.exact and not left.extend(state).exact
    assert state.antecedents() == (*left.states(), source)
    others = [
        ChunkState.recomputed(source, left, 0.3),
        ChunkState.recomputed(source, root, 0.15),
        ChunkState.recomputed(ChunkState.patched("b", 4, left), left, 0.15),
    ]
    assert len({state.digest, *(other.digest for other in others)}) == 4
    assert ChunkState.recomputed(source, left, 0.15) == state


@pytest.mark.parametrize("epsilon", [1e-9, 0.3])  # 0.3: wide enough here for the survivors to stand
def test_an_op_bringing_new_content_behind_an_approximation_is_audited_before_it_forms_it(
    calibrations: Path, epsilon: float
) -> None:
    """An agent's turn: one op drops a chunk from the middle and brings new content at the end.
    The survivors' approximation is tried (audited) and fixed where over ε before the new chunk
    is formed, so the new chunk is formed once, exactly over what stands to its left, and the op
    pays no more than re-prefilling from the dropped chunk's slot. At a tiny ε the window then
    answers like a re-prefill."""
    calibrate_for_tests(backend_named("qwen2").fingerprint, calibrations)
    window = _window(epsilon)
    refs = [window.push(text, label=text) for text in TEXTS[:4]]
    dropped_at = 1
    window.arrange([refs[0], *refs[dropped_at + 1 :], TEXTS[4]], labels=[None, None, None, "new"])
    cost, new = window.stats.last, window.refs[-1]
    assert cost.audits > 0, window.last_plan  # the survivors' approximation was tried
    budget = window._parts.budget
    assert budget is not None and len(budget.audited()) == window.stats.total.audits  # each remembered
    formed = [edit for edit in window.last_plan.edits if edit.ref == new and edit.kind == "form_patch"]
    assert len(formed) == 1 and formed[0].tokens == window.chunk(new).num_tokens
    left = window._parts.core.root
    for ref in window.refs[:-1]:
        left = left.extend(window.state_of(ref))
    assert window.state_of(new).context.digest == left.digest  # formed over what stood, after the fixes
    prefix = sum(window.chunk(ref).num_tokens for ref in window.refs[dropped_at:])
    assert cost.tokens_prefilled - cost.audit_tokens <= prefix
    for ref in window.refs:
        drift = window.drift_of(ref)
        assert drift is not None and drift <= epsilon, (ref, drift)
    if epsilon < 1e-6:
        assert cost.drift_fixes > 0
        assert max(chunk_errors(window).values()) <= EXACT_KV
        assert answer_kl(window) < 1e-9
    else:
        assert cost.tokens_prefilled - cost.audit_tokens < prefix  # the approximation stood
