"""Vouching without an audit: a kept state's class and distance, the bounds fitted on episodes, and
the estimate an engine serves by (audits only tighten it)."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from kamera_agent.bench.calibration_fit import Slot, Step, fit_calibration, load_steps, save_steps
from kamera_agent.bench.vouch_fit import fit_vouching, judge_vouching, vouch_pairs
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.errors import SettingsError
from kamera_agent.fidelity import BUDGETS, DISTANCES, Calibration, DriftBudget, absorbed_gone, vouch_class

ROOT = Context.root("anchor")


def _chain(*states: ChunkState) -> Context:
    ctx = ROOT
    for state in states:
        ctx = ctx.extend(state)
    return ctx


def test_a_kept_state_is_gone_where_anything_its_kv_absorbed_has_left() -> None:
    a, b = ChunkState.canonical("a", ROOT), ChunkState.canonical("b", ROOT)
    b_over_a = ChunkState.patched("b", "full", _chain(a))
    c = ChunkState.patched("c", "full", _chain(b_over_a))  # c absorbed a only through b
    assert not absorbed_gone(a, {"a"})
    assert not absorbed_gone(c, {"a", "b", "c"}) and vouch_class(c, {"a", "b", "c"}) == "present"
    assert absorbed_gone(c, {"b", "c"}) and vouch_class(c, {"b", "c"}) == "gone"  # a left: c still carries it
    assert not absorbed_gone(ChunkState.patched("c", "full", _chain(b)), {"b", "c"})
    # a recomputed state keeps its source's other tokens: what the source absorbed counts
    recomputed = ChunkState.recomputed(ChunkState.patched("d", "full", _chain(a)), _chain(b), 0.15)
    assert absorbed_gone(recomputed, {"b", "d"}) and not absorbed_gone(recomputed, {"a", "b", "d"})
    # a splice names no chunks: counted as carrying something gone
    assert absorbed_gone(ChunkState.spliced(c, b_over_a, 2), {"a", "b", "c"})


def test_a_chain_longer_than_the_walk_counts_as_gone() -> None:
    """An engine reads the chain per request: its length is bounded, conservatively."""
    states = [ChunkState.canonical("k0", ROOT)]
    for i in range(1, 6):
        states.append(ChunkState.patched(f"k{i}", "full", _chain(*states)))
    keys = {f"k{i}" for i in range(6)}
    assert not absorbed_gone(states[-1], keys, limit=5)
    assert absorbed_gone(states[-1], keys, limit=4)


def test_an_orbit_state_encodes_the_set_behind_it() -> None:
    a, b = ChunkState.canonical("a", ROOT), ChunkState.canonical("b", ROOT)
    left = _chain(a, b)
    orbit = ChunkState.orbit("c", "full", ROOT, "addr", ["m1", "m2"], keyset=left.keyset)
    assert not absorbed_gone(orbit, {"a", "b", "c"}, left)
    assert absorbed_gone(orbit, {"a", "b", "c"}, _chain(a))  # served over another set: unknown
    assert absorbed_gone(orbit, {"a", "b", "c"})  # no left context given: unknown


def _slots(errors: list[float], gone: bool | None, exact_first: int = 1) -> tuple[Slot, ...]:
    head = tuple(Slot(0.0, 0.0, True, 10, False) for _ in range(exact_first))
    return head + tuple(Slot(e, e, False, 10, gone) for e in errors)


def test_bounds_are_a_quantile_per_class_and_distance_never_rising_with_distance() -> None:
    steps = [
        Step("slide", _slots([0.30, 0.05, 0.02], True), 0.004, True),
        Step("slide", _slots([0.20, 0.08, 0.01], True), 0.002, True),
        Step("reorder", _slots([0.04, 0.01, 0.03], False), 0.001, True),
        Step("recall", _slots([0.50, 0.2], True), 0.3, False),
    ]
    fitted = fit_vouching(steps, quantile=1.0)
    assert fitted is not None
    gone, present = fitted.bounds["gone"], fitted.bounds["present"]
    assert len(gone) == DISTANCES and gone[0] == 0.5 and gone[1] == 0.2 and gone[2] == 0.02
    assert present[0] == 0.04 and present[1] == 0.03 and present[2] == 0.03  # raised to distance 2's
    assert all(x >= y for x, y in itertools.pairwise(gone)) and gone[-1] == 0.0
    # an op stands where every approximated chunk's bound is within ε: the reorder from 0.04,
    # the slides from 0.3 (their first chunk's bound), the recall that flipped only from 0.5
    points = fitted.frontier
    assert points["0.03"]["standing"] == 0 and points["0.1"]["standing"] == 0.25
    assert points["0.5"]["standing"] == 1.0 and points["0.5"]["agreement"] == 0.75
    # four ops cannot show 99 % agreement: no point with anything standing passes
    assert fitted.budget == 0.03
    # enough ops that kept their answers show it: the pick stops below the flipping recall
    many = [steps[2]] * 100 + [*steps[:2]] * 50 + [steps[3]] * 20
    enough = fit_vouching(many, quantile=1.0)
    assert enough is not None and enough.budget == 0.3
    # (the slides stand only at 0.5: the recall raised the gone class's bound at distance 0)
    assert enough.frontier["0.3"]["standing"] == 100 / 220 and enough.frontier["0.5"]["agreement"] < 0.99
    # steps saved before classes were recorded fit no bounds
    assert fit_vouching([Step("slide", _slots([0.1], None), 0.0, True)], 0.99) is None
    assert vouch_pairs(_slots([0.1, 0.2], True)) == [("gone", 0, 0.1), ("gone", 1, 0.2)]


def test_held_out_chunks_are_judged_by_the_share_within_eps_that_measure_over_three_eps() -> None:
    bounds = {"gone": (0.2, 0.05), "present": (0.01,)}
    calibration = Calibration("f", 1.0, vouch_bounds=bounds, vouch_budget=0.2)
    held = [
        Step("slide", _slots([0.15, 0.04, 0.2], True), 0.0, True),
        Step("reorder", _slots([0.04, 0.005], False), 0.0, True),
    ]
    judged = judge_vouching(calibration, held)
    assert judged["0.01"] == {"within": 2, "over": 0.5, "chunks": 5}  # the 0.04 reorder chunk is over 3ε
    assert judged["0.1"]["within"] == 4 and judged["0.1"]["over"] == 0.0
    assert judged["0.001"]["within"] == 0 and math.isnan(judged["0.001"]["over"])
    assert set(judged) == {f"{eps:g}" for eps in BUDGETS}
    with pytest.raises(SettingsError, match="kamera calibrate"):
        judge_vouching(calibration, [Step("slide", _slots([0.1], None), 0.0, True)])


def test_a_calibration_carries_its_bounds_through_json_and_its_fit() -> None:
    calibration = Calibration("f", 2.0, vouch_bounds={"gone": (0.3, 0.1)}, vouch_budget=0.1)
    again = Calibration.from_json(calibration.to_json())
    assert again == calibration and again.vouch_bound("gone", 0) == 0.3
    assert again.vouch_bound("gone", 7) == 0.1 and again.vouch_bound("present", 0) is None
    assert Calibration.from_json(json.dumps({"fingerprint": "f", "scale": 1.0})).vouch_bounds == {}
    steps = [
        Step("slide", _slots([0.3, 0.05], True), 0.004, True),
        Step("reorder", _slots([0.04, 0.01], False), 0.001, True),
    ]
    fitted = fit_calibration("f", steps * 100, (1,), 0.1)
    assert fitted.vouch_bounds["gone"][0] == 0.3 and fitted.vouch_budget >= 0.3
    assert set(fitted.vouch_frontier) == {f"{eps:g}" for eps in BUDGETS}


def test_steps_keep_the_class_of_each_slot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    steps = [Step("slide", _slots([0.3], True), 0.004, True), Step("push", _slots([0.1], None), 0.0, True)]
    path = tmp_path / "steps.json"
    save_steps(steps, path, "f", (1,), 0.1)
    loaded, meta = load_steps(path)
    assert loaded == steps and meta["fingerprint"] == "f"


def test_audits_only_tighten_what_the_calibration_vouches_for() -> None:
    a = ChunkState.canonical("a", ROOT)
    kept = ChunkState.patched("b", "full", _chain(a))  # b absorbed a, which has left
    left = ROOT
    bounded = Calibration("f", 2.0, 0.5, vouch_bounds={"gone": (0.3, 0.1)}, vouch_budget=0.2)
    budget = DriftBudget(1.0, bounded)
    nothing_filed = lambda state, ctx: None  # noqa: E731
    assert budget.vouch(kept, left, 0.0, nothing_filed, 0, {"b"}) == 0.3
    assert budget.vouch(kept, left, 0.0, nothing_filed, 3, {"b"}) == 0.1
    assert budget.vouch(kept, left, 0.4, nothing_filed, 3, {"b"}) == pytest.approx(0.2)  # inherits 0.5 × 0.4
    assert budget.vouch(kept, left, 0.0, nothing_filed, 0, {"a", "b"}) is None  # no "present" bound fitted
    assert budget.vouch_epsilon == 0.2  # the bounds serve within their own ε, never above the window's
    assert DriftBudget(0.1, bounded).vouch_epsilon == 0.1
    # a filed audit over the bound raises the estimate; one under it does not lower it
    assert budget.vouch(kept, left, 0.0, lambda state, ctx: 0.4, 3, {"b"}) == pytest.approx(0.8)
    assert DriftBudget(1.0, bounded).vouch(kept, left, 0.0, lambda state, ctx: 0.01, 0, {"b"}) == 0.3
    # without bounds only an audit vouches (and the window's ε holds)
    plain = DriftBudget(1.0, Calibration("f", 2.0, 0.5))
    assert plain.vouch(kept, left, 0.0, nothing_filed, 0, {"b"}) is None
    assert plain.vouch(kept, left, 0.0, lambda state, ctx: 0.01, 0, {"b"}) == pytest.approx(0.02)
    assert plain.vouch_epsilon == 1.0
