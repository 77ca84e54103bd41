"""`kamera calibrate`: a calibration fitted on a model's own episodes, filed by its fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.progress import Progress

from kamera_agent.bench import calibration_episodes
from kamera_agent.bench.calibration_episodes import FLOOR_EVERY, episodes
from kamera_agent.bench.calibration_fit import (
    Point,
    Slot,
    Step,
    _fix_share,
    _signals,
    fit_calibration,
    floor_agreement,
    frontier,
    judge,
    load_steps,
    pick_budget,
    save_steps,
)
from kamera_agent.cli import main
from kamera_agent.fidelity import (
    AGREEMENT,
    BUDGETS,
    CALIBRATION_DIR_VARIABLE,
    MEAN_KL,
    Calibration,
    calibration_dirs,
    find_calibration,
)
from kamera_agent.window import KameraWindow
from tests.window.backends import backend_named


def test_a_text_models_calibration_bounds_its_quantile_of_fitting_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A text-only model calibrates on passages of real text (its half of the corpus); the fitted
    scale bounds 99 % of the approximated chunks it was fitted on; exact chunks are never fitted.
    A window of 4 (the byte tokenizer makes a passage ~350 tokens)."""
    monkeypatch.setattr(calibration_episodes, "CAPACITY", 4)  # where drift_episode reads it
    backend = backend_named("qwen2")
    with Progress(disable=True) as progress:
        ops = episodes(backend, [1, 2], 16, progress, 0.2)
    assert any(not slot.exact for op in ops for slot in op.slots)  # the unbounded policies approximated
    assert all(slot.own == 0.0 for op in ops for slot in op.slots if slot.exact)
    # every op answered the question: an exact window as re-prefill does, to float noise
    exact_ops = [op for op in ops if all(slot.exact for slot in op.slots)]
    assert exact_ops and all(op.agrees and op.kl < 1e-6 for op in exact_ops)
    assert any(op.kl > 1e-6 for op in ops)  # and an approximated one measurably otherwise
    calibration = fit_calibration(backend.fingerprint, ops, [1, 2], 0.2)
    pairs = [pair for op in _signals(ops, calibration.inherit) for pair in op]
    bounded = sum(error <= calibration.scale * signal + 1e-12 for signal, error in pairs)
    assert bounded >= 0.99 * len(pairs) and calibration.samples == len(pairs)
    judged = judge(calibration, ops)
    assert -1 <= judged.spearman <= 1 and judged.within[0.1] >= judged.within[0.01] >= judged.within[0.001]
    # the default ε is the one its own frontier picks, and the frontier is recorded with it
    points = frontier(calibration, ops)
    assert calibration.budget == pick_budget(points, calibration.floor)
    assert set(calibration.frontier) == {f"{eps:g}" for eps in BUDGETS}
    standing = [p.standing for p in points]
    assert standing == sorted(standing)  # a larger ε lets at least as many ops stand


def _step(op: str, error: float, own: float, kl: float, agrees: bool = True) -> Step:
    """An op whose window holds one exact chunk and one approximated one."""
    return Step(op, (Slot(0.0, 0.0, True), Slot(error, own, False)), kl, agrees)


def test_the_default_budget_is_the_largest_whose_standing_ops_answer_like_a_reprefill() -> None:
    """Ops estimated small answered well, one estimated large flipped its first token: the pick
    stops below the flip; an op with nothing approximated is not an op of the frontier."""
    calibration = Calibration("f", scale=1.0, inherit=0.5)
    steps = [
        _step("slide", 0.004, 0.005, 1e-3),
        _step("reorder", 0.02, 0.025, 2e-3),
        _step("recall", 0.15, 0.15, 0.4, agrees=False),
        Step("push", (Slot(0.0, 0.0, True),), 0.0, True),
    ]
    points = {p.epsilon: p for p in frontier(calibration, steps)}
    assert points[3e-3].standing == 0 and points[3e-3].agreement == 1.0
    assert points[1e-2].standing == 1 / 3 and points[3e-2].standing == 2 / 3
    assert points[0.2].standing == 1.0 and points[0.2].agreement == 2 / 3
    assert pick_budget(list(points.values())) == 0.1
    # a mean KL over the target rules a point out even where every first token agreed
    loud = [_step("slide", 0.004, 0.005, 2 * MEAN_KL)]
    assert pick_budget(frontier(calibration, loud)) == 3e-3
    # nothing passes: the smallest budget (what is approximated is re-prefilled at once)
    assert pick_budget([Point(eps, 1.0, AGREEMENT - 0.01, 0.0) for eps in BUDGETS]) == BUDGETS[0]
    # a failing point is not skipped over: wider points that pass again (diluted) are not picked
    diluted = [Point(eps, 1.0, 1.0 if eps != 3e-2 else AGREEMENT - 0.01, 0.0) for eps in BUDGETS]
    assert pick_budget(diluted) == 1e-2


def test_the_default_budget_keeps_the_first_token_no_less_often_than_the_models_own_bf16() -> None:
    """A model whose bf16 re-prefill never flips its first token on the fitting episodes: a point
    at the agreement target but below that floor is refused; a floor under the target changes
    nothing. The floor is what the steps recorded, saved and loaded with them."""
    points = [Point(eps, 1.0, 1.0 if eps <= 3e-2 else AGREEMENT, 0.0) for eps in BUDGETS]
    assert pick_budget(points) == BUDGETS[-1]
    assert pick_budget(points, floor=1.0) == 3e-2
    assert pick_budget(points, floor=0.9) == BUDGETS[-1]
    steps = [
        Step("slide", (Slot(0.1, 0.1, False, 5, True),), 1e-3, True, floor_agrees=True),
        Step("push", (Slot(0.0, 0.0, True, 5, False),), 0.0, True, floor_agrees=False),
    ]
    assert floor_agreement(steps) == 0.5 and floor_agreement(steps[:1]) == 1.0
    assert floor_agreement([Step("push", (), 0.0, True)]) is None  # steps saved before it was recorded


def test_steps_keep_the_floor_they_recorded(tmp_path: Path) -> None:
    steps = [
        Step("slide", (Slot(0.1, 0.1, False, 5, True),), 1e-3, True, floor_agrees=False),
        Step("push", (Slot(0.0, 0.0, True, 5, False),), 0.0, True),
    ]
    save_steps(steps, tmp_path / "steps.json", "f", (1,), 0.1)
    loaded, _ = load_steps(tmp_path / "steps.json")
    assert loaded == steps


def test_fix_shares_count_what_the_fixes_of_the_ops_that_move_chunks_would_re_prefill() -> None:
    steps = [
        _step("slide", 0.004, 0.005, 1e-3),
        _step("slide", 0.2, 0.2, 1e-3),
        _step("push", 0.2, 0.2, 1e-3),
        _step("reorder", 0.004, 0.005, 1e-3),
    ]
    fitted = fit_calibration("f", steps, [1], 0.1, quantile=0.5)
    shares = fitted.fix_shares
    assert "push" not in shares  # a push moves nothing: its share on an unbounded episode misleads
    over = sum(fitted.scale * s > fitted.budget for s in (0.005, 0.2))
    assert shares["slide"] == (2, float(over)) and shares["reorder"][0] == 1  # one chunk: all of it


def test_a_fix_share_counts_the_chunks_over_budget_each_re_prefilled_alone() -> None:
    """Chunks of 10, 20, 30 and 40 tokens after an exact lead: each chunk estimated over ε costs
    its own tokens; a re-prefilled chunk passes on only what it inherits, so the chunks after it
    are judged without its drift."""
    calibration = Calibration("f", scale=1.0, inherit=0.5, budget=0.1)

    def step(*owns: float) -> Step:
        slots = [Slot(0.0, 0.0, True, 5)]
        slots += [Slot(own, own, False, tokens) for own, tokens in zip(owns, (10, 20, 30, 40), strict=True)]
        return Step("slide", tuple(slots), 1e-3, True)

    assert _fix_share(calibration, step(0.01, 0.01, 0.01, 0.01)) == 0.0
    assert _fix_share(calibration, step(0.5, 0.01, 0.01, 0.01)) == 0.1
    assert _fix_share(calibration, step(0.5, 0.08, 0.01, 0.01)) == 0.1  # not 0.08 + 0.5 × 0.5
    assert (
        _fix_share(calibration, step(0.01, 0.08, 0.5, 0.09)) == 0.7
    )  # 0.09 + 0.5 × 0.085 inherited: over too


def test_the_inherited_share_is_the_one_whose_default_lets_the_most_ops_stand() -> None:
    """Two approximated chunks per good op, the second no worse than the first: a share that
    passes the first's estimate on pushes the good ops over the ε the bad op caps the pick at,
    so the fit keeps the smaller share, and its default lets the good ops stand."""
    good = Step("slide", (Slot(0.0, 0.0, True), Slot(0.02, 0.02, False), Slot(0.02, 0.02, False)), 1e-3, True)
    bad = Step("recall", (Slot(0.0, 0.0, True), Slot(0.05, 0.05, False)), 0.5, False)
    steps = [good] * 4 + [bad]
    fitted = fit_calibration("f", steps, [1], 0.1)
    forced = fit_calibration("f", steps, [1], 0.1, inherit=1.0)
    assert fitted.inherit == 0.0 and fitted.budget == forced.budget == 3e-2
    assert fitted.frontier["0.03"]["standing"] == 0.8 and forced.frontier["0.03"]["standing"] == 0.0


def test_shipped_calibrations_record_the_frontier_their_budget_was_picked_from() -> None:
    """A calibration that ships with a frontier has the budget the rule picks from it: the pick is
    recomputed here from the stored numbers, not taken on trust."""
    shipped = sorted(calibration_dirs()[-1].glob("*.json"))
    with_frontier = 0
    for path in shipped:
        calibration = Calibration.from_json(path.read_text())
        if not calibration.frontier:
            continue
        with_frontier += 1
        points = [
            Point(eps, *(calibration.frontier[f"{eps:g}"][k] for k in ("standing", "agreement", "kl_mean")))
            for eps in BUDGETS
        ]
        assert calibration.budget == pick_budget(points, calibration.floor), path.name
        assert calibration.seeds and calibration.samples > 0 and calibration.fix_shares
    assert with_frontier >= 1


MEASURED = Path(__file__).resolve().parents[2] / "docs" / "results"


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_a_shipped_calibration_is_what_its_stored_episodes_fit(model: str) -> None:
    """The real models' calibrations ship with what their episodes measured (``kamera calibrate
    --steps``): fitted again here, they give the shipped calibration byte for byte: its scale,
    inherited share, frontier, default ε and fix rates are the rule's, not edited by hand."""
    steps, measured = load_steps(MEASURED / "calibration" / f"{model}-steps.json")
    path = calibration_dirs()[-1] / f"{measured['fingerprint'][:32]}.json"
    shipped = Calibration.from_json(path.read_text())
    fitted = fit_calibration(
        measured["fingerprint"], steps, measured["seeds"], measured["audit_share"], quantile=shipped.quantile
    )
    assert fitted.to_json() == shipped.to_json()


def test_kamera_calibrate_files_the_demo_models_calibration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CALIBRATION_DIR_VARIABLE, str(tmp_path))
    steps = tmp_path / "steps" / "demo.json"
    assert (
        main(
            [
                "calibrate",
                "demo",
                "--ops",
                "24",
                "--seeds",
                "5",
                "--out",
                str(tmp_path),
                "--steps",
                str(steps),
            ]
        )
        == 0
    )
    (filed,) = tmp_path.glob("*.json")
    data = json.loads(filed.read_text())
    # fitted again from what the episodes measured, without running them: the same calibration
    again = tmp_path / "again"
    assert main(["calibrate", "demo", "--refit", str(steps), "--out", str(again)]) == 0
    assert (again / filed.name).read_text() == filed.read_text()
    assert data["seeds"] == [5] and data["samples"] > 0 and data["scale"] > 0
    assert 0.0 <= data["floor"] <= 1.0  # the episodes measured the model's own bf16 re-prefill
    floors = [step.floor_agrees is not None for step in load_steps(steps)[0]]
    assert floors == [index % FLOOR_EVERY == 0 for index in range(24)]  # on a sample of the ops
    # the fitting episodes' moving ops, counted at the picked budget, ship with the calibration
    shares = data["fix_shares"]
    assert shares and all(0 <= spent <= ops for ops, spent in shares.values())
    assert sum(ops for ops, _ in shares.values()) > 0
    from kamera_agent.demo.model import load_demo_model

    model, tokenizer, image_processor = load_demo_model()
    window = KameraWindow(model, tokenizer=tokenizer, image_processor=image_processor)
    found = find_calibration(window.backend.fingerprint)
    assert found is not None and found.seeds == (5,)  # the user's directory comes before the shipped one
    assert window.budget == found.budget
    assert "filed at" in capsys.readouterr().out
