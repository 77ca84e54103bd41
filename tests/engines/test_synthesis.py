"""A synthesized prefix against the model's own forward: what is served, in which state, and its KV.

The "engine" here is the transformers model itself: a request is its anchor and chunks prefilled
in order; capture reads each chunk's KV from that forward; a load's KV, placed at the request's
positions, must equal the model's own KV of the state it was served in at those positions (a
forward of that state's chunks shifted by the move: attention sees relative positions only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import kamera_agent.engines.synthesis as synthesis_module
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.config import WindowConfig
from kamera_agent.core.identity import Context
from kamera_agent.engines.chunking import keyed
from kamera_agent.engines.synthesis import KeptBudget, PrefixSynthesis, RequestChunk, serve_mode_of, serving
from kamera_agent.errors import UncalibratedWarning
from kamera_agent.fidelity import (
    CALIBRATION_DIR_VARIABLE,
    Calibration,
    DriftBudget,
    relative_error,
    save_calibration,
)
from kamera_agent.operator.layout import ChunkKV, relocate, to_position_free
from kamera_agent.store import ChunkStore, DriftAudit
from tests.backends.test_transformers_backend import text_backend

EXACT = 2e-5
NS = "tenant-a|"


def _backend():  # type: ignore[no-untyped-def]
    return text_backend("qwen2", layers=4)


def _texts(*words: str) -> list[Chunk]:
    encoder = _backend().encoder
    return [encoder.text(f"the {w} was seen near the window at noon") for w in words]


def _long(word: str) -> Chunk:
    return _backend().encoder.text(f"a much longer note: the {word} wandered in, ate, slept and left again")


def _request(chunks: Sequence[Chunk], namespace: str = NS) -> list[RequestChunk]:
    """The anchor and ``chunks`` as one request's chunks (content keys from their tokens)."""
    tokens: list[int] = []
    bounds: list[tuple[int, int, str]] = []
    for chunk in [_backend().anchor, *chunks]:
        ids = chunk.input_ids.tolist()
        bounds.append((len(tokens), len(tokens) + len(ids), "text"))
        tokens += ids
    return keyed(tokens, bounds, namespace)


def _forward(chunks: Sequence[Chunk], shift: int = 0) -> list[ChunkKV]:
    """The model's own KV of anchor + chunks, every position moved by ``shift``; anchor first."""
    backend = _backend()
    anchor = backend.anchor
    first = backend.prefill([anchor], [], shift).kv[0]
    return [first, *backend.prefill_sequence(chunks, shift=shift)]


def _capture(synthesis: PrefixSynthesis, chunks: Sequence[Chunk], namespace: str = NS) -> int:
    """A prefill of anchor + chunks, captured from the model's own KV."""
    request, kvs = _request(chunks, namespace), _forward(chunks)
    by_start = {c.start: kv for c, kv in zip(request, kvs, strict=True)}
    layout = _backend().layout
    return synthesis.capture(
        namespace, request, request[-1].end, lambda c: to_position_free(by_start[c.start], layout)
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _store() -> ChunkStore:
    return ChunkStore(fingerprint=_backend().fingerprint, memory_limit=1 << 28)


def test_exact_serves_what_a_re_prefill_computes_and_nothing_else() -> None:
    s, a, b, c, d = _texts("cat", "dog", "owl", "fox", "elk")
    synthesis = PrefixSynthesis(_store(), serve_mode_of(WindowConfig.exact()))
    assert synthesis.mode == "exact"
    assert _capture(synthesis, [s, a, b, c]) == 5  # anchor canonical + four conditioned states
    assert _capture(synthesis, [s, a, b, c]) == 0  # captured once

    request = _request([s, a, b, c, d])
    plan = synthesis.plan(NS, request, 0, request[-1].end)
    assert [item.chunk for item in plan.served] == request[:5] and plan.end == request[4].end
    kvs = synthesis.load(plan).kvs
    assert kvs
    truth = _forward([s, a, b, c, d])
    layout = _backend().layout
    for kv, want in zip(kvs, truth, strict=False):
        assert want.positions is not None
        placed = relocate(kv, layout, want.positions)
        assert _rel(placed.keys, want.keys) < EXACT and _rel(placed.values, want.values) < EXACT

    moved = _request([a, s, b])  # a new order: only what a re-prefill computes may be served
    plan = synthesis.plan(NS, moved, 0, moved[-1].end)
    assert [item.chunk for item in plan.served] == moved[:1]  # the anchor alone (canonical)


def test_keep_serves_a_moved_chunk_in_the_state_it_was_captured_in() -> None:
    s, a, b, c, d = _texts("cat", "dog", "owl", "fox", "elk")
    x, y = _long("yak"), _long("emu")
    synthesis = PrefixSynthesis(_store(), serve_mode_of(WindowConfig()))
    assert synthesis.mode == "keep"
    _capture(synthesis, [s, a, b, c])
    slid = _request([x, y, b, c, d])  # a and s left, b and c moved right
    anchor_len = slid[0].end
    plan = synthesis.plan(NS, slid, anchor_len, slid[-1].end)  # the engine holds the anchor
    # x and y were never captured: nothing after them can be served (the chain needs them)
    assert plan.tokens == 0
    _capture(synthesis, [x, y])
    plan = synthesis.plan(NS, slid, anchor_len, slid[-1].end)
    assert [item.chunk for item in plan.served] == slid[1:5]
    assert [item.computed for item in plan.served] == [True, True, False, False]
    kvs = synthesis.load(plan).kvs
    assert kvs
    layout = _backend().layout
    # b and c hold what they absorbed behind s and a: the model's own KV of that forward, moved
    old = _request([s, a, b, c])
    for kv, served, origin in zip(kvs[2:], plan.served[2:], old[3:], strict=True):
        shift = served.chunk.start - origin.start
        assert shift > 0
        truth = _forward([s, a, b, c], shift=shift)[old.index(origin)]
        assert truth.positions is not None and truth.positions[0] == served.chunk.start
        placed = relocate(kv, layout, truth.positions)
        assert _rel(placed.keys, truth.keys) < EXACT and _rel(placed.values, truth.values) < EXACT

    exact = PrefixSynthesis(synthesis.store, "exact")  # the same store in the exact mode
    assert [item.chunk for item in exact.plan(NS, slid, anchor_len, slid[-1].end).served] == slid[1:3]


def test_a_load_is_remembered_so_later_chunks_chain_the_kept_states() -> None:
    s, a, b, x, d = _texts("cat", "dog", "owl", "yak", "elk")
    synthesis = PrefixSynthesis(_store(), "keep")
    _capture(synthesis, [s, a, b])
    _capture(synthesis, [x])
    slid = _request([x, b, d])
    plan = synthesis.plan(NS, slid, 0, slid[-1].end)
    assert [item.chunk for item in plan.served] == slid[:3] and not plan.served[2].computed
    synthesis.loaded(NS, slid, plan)
    # d is computed over the kept b; its capture files it under that chain, so a request that
    # finds x, b, d in the engine's own cache is served d's stored state, not a re-prefill's
    request = _request([x, b, d, a])
    captured = synthesis.capture(NS, slid, slid[-1].end, lambda c: _fake_kv(len(c)))
    assert captured == 1  # d alone: the rest was loaded from the store
    plan = synthesis.plan(NS, request, slid[-1].end, request[-1].end)
    assert [item.chunk for item in plan.served] == request[4:]  # a, in the state it was captured in
    assert not plan.served[0].computed
    exact = PrefixSynthesis(synthesis.store, "exact")
    assert exact.plan(NS, request, slid[-1].end, request[-1].end).served == ()


def test_namespaces_never_share_kv() -> None:
    s, a = _texts("cat", "dog")
    synthesis = PrefixSynthesis(_store(), "keep")
    _capture(synthesis, [s, a])
    other = _request([s, a], namespace="tenant-b|")
    assert synthesis.plan("tenant-b|", other, 0, other[-1].end).served == ()


def test_plans_are_page_aligned_and_a_load_with_an_entry_gone_is_declined() -> None:
    s, a, b = _texts("cat", "dog", "owl")
    synthesis = PrefixSynthesis(_store(), "exact")
    _capture(synthesis, [s, a, b])
    request = _request([s, a, b])
    page = 4
    device = request[1].start + 5 - (request[1].start + 5) % page  # the engine's hit ends inside a chunk
    plan = synthesis.plan(NS, request, device, request[-1].end - 1, page_size=page)
    assert plan.end % page == 0 and plan.device_len == device and plan.tokens > 0
    assert plan.end <= request[-1].end - 1 < plan.end + page
    first = plan.served[0]
    assert first.chunk.start < device and first.skip == device - first.chunk.start
    assert synthesis.plan(NS, request, device, request[-1].end - 1, page_size=page) == plan  # no side effects
    loaded = synthesis.load(plan)
    assert loaded.ok and [kv.num_tokens for kv in loaded.kvs] == [len(i.chunk) for i in plan.served]
    partial = PrefixSynthesis(_store(), "exact")  # a store that lost the last chunk's entry
    _capture(partial, [s, a])
    declined = partial.load(plan)
    assert not declined.ok and not declined.kvs and declined.failed == (plan.served[-1].entry,)


def _fake_kv(n: int) -> ChunkKV:
    layout = _backend().layout
    (h, dk), (hv, dv) = layout.keys_shape, layout.values_shape
    return ChunkKV(torch.randn(layout.num_layers, h, n, dk), torch.randn(layout.num_layers, hv, n, dv))


def test_a_kept_state_finishing_a_chunk_the_engine_began_is_a_named_splice() -> None:
    s, a, b, x = _texts("cat", "dog", "owl", "yak")
    synthesis = PrefixSynthesis(_store(), "keep")
    _capture(synthesis, [s, a])
    _capture(synthesis, [x])
    request = _request([x, a, b])
    head = request[2].start + 3  # the engine's own hit ends 3 tokens into a (a shared header)
    plan = synthesis.plan(NS, request, head, request[-1].end)
    (served,) = plan.served  # a, its tail from its kept state; b was never captured
    assert served.skip == 3 and served.state.kind == "spliced" and not served.state.exact
    assert plan.end == request[2].end
    synthesis.loaded(NS, request, plan)
    # b computed after the splice is captured under a chain that names the splice, and found again
    assert synthesis.capture(NS, request, request[-1].end, lambda c: _fake_kv(len(c))) == 2  # a, b
    again = synthesis.plan(NS, request, request[2].end, request[-1].end)
    assert [item.chunk for item in again.served] == request[3:] and again.served[0].computed
    assert PrefixSynthesis(synthesis.store, "exact").plan(NS, request, head, request[-1].end).served == ()


def test_what_a_synthesis_remembers_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.setattr(synthesis_module, "MEMORY", 3)
    synthesis = PrefixSynthesis(_store(), "keep")
    _capture(synthesis, _texts("cat", "dog", "owl", "yak", "emu"))
    assert len(synthesis._latest) == 3  # the five chunks and the anchor seen, the last three kept


def test_an_engine_serves_what_a_window_stored_and_a_window_what_an_engine_captured() -> None:
    """One key and state scheme: the same text behind the same anchor is the same chunk and state
    for a window and an engine adapter (namespace ``""``: no tenant), so each serves the other's KV."""
    from kamera_agent import KameraWindow

    s, a, b = _texts("cat", "dog", "owl")
    store = _store()
    window = KameraWindow(_backend(), config=WindowConfig.exact(), store=store)
    for chunk in (s, a, b):
        window.push(chunk)
    request = _request([s, a, b], namespace="")
    assert [c.key for c in request] == [_backend().anchor.key, s.key, a.key, b.key]
    synthesis = PrefixSynthesis(store, "exact")
    anchor_len = request[0].end  # the engine holds the anchor (its own prefix cache)
    plan = synthesis.plan("", request, anchor_len, request[-1].end)
    assert [item.chunk for item in plan.served] == request[1:]
    kvs = synthesis.load(plan).kvs
    assert kvs
    layout, truth = _backend().layout, _forward([s, a, b])
    for kv, want in zip(kvs, truth[1:], strict=True):
        assert want.positions is not None
        placed = relocate(kv, layout, want.positions)
        assert _rel(placed.keys, want.keys) < EXACT and _rel(placed.values, want.values) < EXACT

    captured = _store()  # the reverse: an engine's prefill captured, then a window over that store
    assert _capture(PrefixSynthesis(captured, "exact"), [s, a, b], namespace="") == 4
    reader = KameraWindow(_backend(), config=WindowConfig.exact(), store=captured)
    for chunk in (s, a, b):
        reader.push(chunk)
    pushed = reader.stats.total  # every chunk served from what the engine captured: no forward
    assert pushed.forwards == 0 and pushed.tokens_reused == sum(c.num_tokens for c in (s, a, b))
    for ref, want in zip(reader.refs, truth[1:], strict=True):
        got = reader.chunk_kv(ref)
        assert _rel(got.keys, want.keys) < EXACT and _rel(got.values, want.values) < EXACT


def _calibration(budget: float = 0.05) -> Calibration:
    return Calibration(_backend().fingerprint, scale=2.0, inherit=0.5, budget=budget)


def test_kept_states_are_served_only_where_a_filed_audit_puts_them_within_the_budget() -> None:
    """Under a drift budget a kept state is an approximation the store must vouch for: served
    where an audit filed for it behind the request's left context (as a window sharing the
    store files one) puts its estimate within ε, counting the kept chunks to its left; never
    unaudited. The audit here is the true error: the kept KV against the model's own forward."""
    s, a, b, c, d = _texts("cat", "dog", "owl", "fox", "elk")
    x, y = _long("yak"), _long("emu")
    store = _store()
    calibration = _calibration()
    synthesis = PrefixSynthesis(store, "keep", KeptBudget(DriftBudget(1.0, calibration), store))
    _capture(synthesis, [s, a, b, c])
    _capture(synthesis, [x, y])
    slid = _request([x, y, b, c, d])
    start, end = slid[0].end, slid[-1].end
    plan = synthesis.plan(NS, slid, start, end)
    assert [item.chunk for item in plan.served] == slid[1:3]  # b unaudited: refused, the rest computed
    assert plan.refused and plan.kept_tokens == 0 and plan.drift == 0.0

    free = replace(synthesis, budget=None).plan(NS, slid, start, end)  # unbounded: b and c kept
    assert [item.computed for item in free.served] == [True, True, False, False]
    assert free.drift is None and free.kept_tokens == len(slid[3]) + len(slid[4])
    kvs = synthesis.load(free).kvs
    assert kvs
    layout, truth = _backend().layout, _forward([x, y, b, c, d])
    left = Context.root(slid[0].key)
    errors = []
    for item, kv, exact in zip(free.served, kvs, truth[1:], strict=False):
        assert exact.positions is not None
        errors.append(relative_error(relocate(kv, layout, exact.positions), exact))
        if not item.computed:  # a window's audit of the kept state behind what the request holds
            store.put_audit(
                DriftAudit(item.chunk.key, item.state.digest, left.digest, errors[-1], len(item.chunk))
            )
        left = left.extend(item.state)
    b_error, c_error = errors[2], errors[3]
    assert errors[:2] == pytest.approx([0, 0], abs=EXACT) and b_error > 1e-3 and c_error > 1e-3
    b_drift = 2.0 * b_error
    c_drift = 2.0 * c_error + 0.5 * b_drift  # c inherits a share of what b carries
    for epsilon, served in ((0.99 * b_drift, 2), (1.01 * b_drift, 3), (1.01 * max(b_drift, c_drift), 4)):
        bounded = replace(synthesis, budget=KeptBudget(DriftBudget(epsilon, calibration), store))
        plan = bounded.plan(NS, slid, start, end)
        assert len(plan.served) == served and plan.refused == (served < 4), (epsilon, b_drift, c_drift)
        drifts = [item.drift for item in plan.served]
        assert drifts == pytest.approx([0, 0, b_drift, c_drift][:served])
        assert plan.drift == pytest.approx(max(drifts)) and plan.drift <= epsilon
        # remembered with the load: a later request finding the chunks in the engine's cache inherits it
        records = bounded.loaded(NS, slid, plan)
        assert [r.drift for r in records] == pytest.approx(drifts[2:])


def test_a_calibrations_bounds_vouch_for_kept_states_no_audit_measured() -> None:
    """Without any audit, a calibration's bounds (`Calibration.vouch_bounds`) vouch for a kept
    state by its class and distance from the request's first approximated chunk: served within
    the bounds' ε, refused past it, and an audit filed for it only ever raises its estimate."""
    s, a, b, c, d = _texts("cat", "dog", "owl", "fox", "elk")
    x, y = _long("yak"), _long("emu")
    store = _store()
    _capture(probe := PrefixSynthesis(store, "keep", None), [s, a, b, c])
    _capture(probe, [x, y])
    slid = _request([x, y, b, c, d])  # b and c absorbed s and a, gone from this request
    start, end = slid[0].end, slid[-1].end
    bounds = {"gone": (0.3, 0.1), "present": (0.05,)}

    def engine(epsilon: float, vouch_budget: float) -> PrefixSynthesis:
        calibration = replace(_calibration(), vouch_bounds=bounds, vouch_budget=vouch_budget)
        return replace(probe, budget=KeptBudget(DriftBudget(epsilon, calibration), store))

    plan = engine(1.0, 0.5).plan(NS, slid, start, end)
    assert [item.computed for item in plan.served] == [True, True, False, False] and not plan.refused
    # b is the first approximated chunk (distance 0); c inherits half of b's estimate (inherit 0.5)
    assert [item.drift for item in plan.served] == pytest.approx([0, 0, 0.3, 0.15])
    assert plan.drift == pytest.approx(0.3) and plan.kept_tokens == len(slid[3]) + len(slid[4])
    for epsilon, vouch_budget in ((0.2, 0.5), (1.0, 0.2)):  # the window's ε, or the bounds' own
        refused = engine(epsilon, vouch_budget).plan(NS, slid, start, end)
        assert len(refused.served) == 2 and refused.refused and refused.kept_tokens == 0
    # an audit over the bound raises b's estimate past ε; one under it leaves the bound
    left = Context.root(slid[0].key)
    for item in plan.served[:2]:
        left = left.extend(item.state)
    b_state = plan.served[2].state
    store.put_audit(DriftAudit(slid[3].key, b_state.digest, left.digest, 0.01, len(slid[3])))
    assert engine(1.0, 0.5).plan(NS, slid, start, end).served[2].drift == pytest.approx(0.3)
    store.put_audit(DriftAudit(slid[3].key, b_state.digest, left.digest, 0.3, len(slid[3])))
    raised = engine(1.0, 0.5).plan(NS, slid, start, end)
    assert len(raised.served) == 2 and raised.refused  # 2.0 × 0.3 = 0.6 over the bounds' ε 0.5


def test_engines_serve_kept_states_within_the_models_calibrated_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serving`: the keep mode bounded by the model's calibration (its ε, or the one given), exact
    without a calibration (one warning), unbounded only when asked (``drift_budget=None``)."""
    monkeypatch.setenv(CALIBRATION_DIR_VARIABLE, str(tmp_path))
    store, fingerprint = _store(), _backend().fingerprint
    keep = WindowConfig(survivors="keep")
    assert serving(WindowConfig.exact(), store, fingerprint) == ("exact", None)
    assert serving(keep.model_copy(update={"drift_budget": None}), store, fingerprint) == ("keep", None)
    assert serving(keep.model_copy(update={"drift_budget": 0.0}), store, fingerprint) == ("exact", None)
    with pytest.warns(UncalibratedWarning, match="kamera calibrate"):
        assert serving(keep, store, fingerprint) == ("exact", None)
    save_calibration(_calibration(0.03), tmp_path)
    mode, budget = serving(keep, store, fingerprint)
    assert mode == "keep" and budget is not None and budget.epsilon == 0.03 and budget.audits is store
    _, budget = serving(keep.model_copy(update={"drift_budget": 0.1}), store, fingerprint)
    assert budget is not None and budget.epsilon == 0.1
    assert serving(keep, store, "another model") == ("exact", None)  # never another model's constants


def test_a_windows_audits_let_an_engine_serve_its_kept_states_within_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path on one store: an engine captures an agent's conversation under its salt; a
    window with the same ``cache_salt`` holds it (served from those captures: no forward) and
    slides, its budget auditing the survivors it keeps and filing the audits; the engine, asked
    the slid conversation, serves those kept states with exactly the drift the window estimates
    (same audits, same calibration), and refuses them without the window's audits."""
    from kamera_agent import KameraWindow
    from tests.window.helpers import calibrate_for_tests

    monkeypatch.setenv(CALIBRATION_DIR_VARIABLE, str(tmp_path))
    calibration = calibrate_for_tests(_backend().fingerprint, tmp_path, budget=10.0)  # wide: kept
    notes = [f"the {w} was seen near the window at noon" for w in ("cat", "dog", "owl", "fox", "elk")]
    s, a, b, c, d = (_backend().encoder.text(note) for note in notes)
    salted = "|agent-1"
    store = _store()
    engine = PrefixSynthesis(store, "keep", KeptBudget(DriftBudget(10.0, calibration), store))
    _capture(engine, [s, a, b, c], namespace=salted)
    slid = _request([a, b, c, d], namespace=salted)
    unaudited = engine.plan(salted, slid, slid[0].end, slid[-1].end)
    assert unaudited.served == () and unaudited.refused  # a's kept state: nobody audited it

    window = KameraWindow(
        _backend(), config=WindowConfig(drift_budget=10.0), store=store, cache_salt="agent-1"
    )
    assert _request([s], namespace=salted)[0].key == window.encoder.anchor().key
    for note in notes[:4]:
        window.push(note)
    assert window.stats.total.forwards == 0  # the engine's captures, in the window's namespace
    window.slide(1)  # survivors keep what they absorbed from s; the budget audits and files them
    drifts = [window.drift_of(ref) for ref in window.refs]
    assert window.stats.last.audits == 3 and all(d is not None and 0 < d <= 10.0 for d in drifts)

    plan = engine.plan(salted, slid, slid[0].end, slid[-1].end)
    assert [item.chunk for item in plan.served] == slid[1:4] and not plan.refused
    assert [item.drift for item in plan.served] == pytest.approx(drifts)
    assert plan.kept_tokens == sum(len(chunk) for chunk in slid[1:4])
    other = KameraWindow(_backend(), config=WindowConfig.exact(), store=store)  # no salt: not its chunks
    assert other.encoder.anchor().key != window.encoder.anchor().key
