"""Does the drift estimate calibrate on episodes it was not fitted on?

Why: a drift budget keeps every chunk's *estimated* drift within ε (`kamera_agent.fidelity`);
that is only worth something if, among chunks the estimate puts within ε, almost none truly
exceed it. This runs the window suite's episode on the shipped demo model (or ``--model``: a checkpoint
folder or GGUF file, whose episodes read passages of real text) with the policies unbounded
(what a budget would audit), and after every op measures, for every chunk the window
does not hold exactly, its true relative KV error against the model's own re-prefill and the
estimate the budget computes (a sampled audit over the window's own context, scaled, plus the
calibration's share of the largest estimate to its left). The calibration is the model's own
(``kamera calibrate``, fitted on other seeds: `kamera_agent.bench.calibration_episodes.FIT_SEEDS`), or
fitted here on ``--fit-seeds``; it is judged on ``--seeds``, disjoint from both.

Reported per ε of the calibration's frontier (`kamera_agent.fidelity.BUDGETS`): how many approximated
chunk-states the estimate puts within ε and the share of those truly over 3ε (target ≤ 1 %);
the Spearman correlation of estimate and true error (target ≥ 0.8); the audits' tokens beside
re-prefilling the window after every op.

    .venv/bin/python benchmarks/drift_estimator.py                 # the shipped calibration, seeds 7101 7102
    .venv/bin/python benchmarks/drift_estimator.py --fit-seeds 11 12 --seeds 21 --ops 40
    .venv/bin/python benchmarks/drift_estimator.py --model SmolLM2-135M-Instruct.Q4_1.gguf --ops 60
    .venv/bin/python benchmarks/drift_estimator.py --from-steps \
        docs/results/calibration/smollm2-held-out-steps.json

Where the calibration fitted plan-time bounds (`Calibration.vouch_bounds`: what an engine vouches
for a kept state by without an audit), the same chunk-states are judged by those too.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from rich.progress import Progress
from rich.table import Table

from kamera_agent.bench.calibration_episodes import HELD_SEEDS, episodes
from kamera_agent.bench.calibration_fit import Step, fit_calibration, judge, load_steps, save_steps
from kamera_agent.bench.common import show_and_save
from kamera_agent.bench.vouch_fit import judge_vouching
from kamera_agent.demo.model import load_demo_model
from kamera_agent.fidelity import BUDGETS, Calibration, find_calibration
from kamera_agent.loading import load_backend
from kamera_agent.settings import configure_threads
from kamera_agent.window import KameraWindow


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=120)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(HELD_SEEDS))
    parser.add_argument("--fit-seeds", type=int, nargs="+", default=None, help="fit here instead")
    parser.add_argument("--model", default=None, help="a checkpoint folder or GGUF file (default: the demo)")
    parser.add_argument("--steps", default=None, help="also write the held-out episodes' steps here")
    parser.add_argument(
        "--from-steps",
        default=None,
        help="judge the steps a run wrote (--steps, or kamera calibrate --steps) instead of running "
        "episodes: the model's own calibration, found by the fingerprint the file records",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.from_steps is not None:
        held, meta = load_steps(Path(args.from_steps))
        args.seeds, args.ops = meta["seeds"], len(held) // max(1, len(meta["seeds"]))
        calibration = _own_calibration(parser, meta["fingerprint"], args.seeds)
    else:
        calibration, held = _run(parser, args)
    return _report(calibration, held, args)


def _own_calibration(parser: argparse.ArgumentParser, fingerprint: str, seeds: list[int]) -> Calibration:
    found = find_calibration(fingerprint)
    if found is None:
        parser.error("the model has no calibration: run `kamera calibrate MODEL` or pass --fit-seeds")
    if set(found.seeds) & set(seeds):
        parser.error(f"--seeds overlap the calibration's fitting seeds {found.seeds}")
    return found


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Calibration, list[Step]]:
    """The calibration (the model's own, or fitted on ``--fit-seeds``) and the held-out steps."""
    configure_threads(None)
    window: dict[str, Any] = {}
    if args.model is None:
        model, tokenizer, image_processor = load_demo_model()
        window = {"tokenizer": tokenizer, "image_processor": image_processor}
    else:
        model = load_backend(args.model)
    fingerprint = KameraWindow(model, **window).backend.fingerprint
    with Progress() as progress:
        if args.fit_seeds is not None:
            if set(args.fit_seeds) & set(args.seeds):
                parser.error("--fit-seeds and --seeds must be disjoint")
            fitted = episodes(model, args.fit_seeds, args.ops, progress, 0.1, **window)
            calibration = fit_calibration(fingerprint, fitted, args.fit_seeds, 0.1)
        else:
            calibration = _own_calibration(parser, fingerprint, args.seeds)
        held = episodes(model, args.seeds, args.ops, progress, calibration.audit_share, **window)
    if args.steps:
        save_steps(held, Path(args.steps), fingerprint, args.seeds, calibration.audit_share)
    return calibration, held


def _report(calibration: Calibration, held: list[Step], args: argparse.Namespace) -> dict[str, Any]:
    judged = judge(calibration, held)
    epsilons = sorted({*BUDGETS, calibration.budget})
    rows = [
        {
            "ε": eps,
            "estimated within ε": judged.within[eps],
            "truly over 3ε": judged.over[eps],
            "truly within ε": sum(e <= eps for _, e in judged.pairs) / len(judged.pairs),
        }
        for eps in epsilons
    ]
    table = Table(
        title=f"drift estimate on {len(judged.pairs)} approximated chunk-states (held-out episodes)"
    )
    for column in rows[0]:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            f"{row['ε']:g}", str(row["estimated within ε"]), *(f"{row[k]:.1%}" for k in list(row)[2:])
        )
    reprefill = sum(len(step.slots) for step in held)
    table.caption = (
        f"calibration: scale {calibration.scale:.3g}, inherit {calibration.inherit:g}, audit "
        f"{calibration.audit_share:.0%} of a chunk's tokens, fitted on seeds {list(calibration.seeds)}; "
        f"judged on seeds {args.seeds} ({args.ops} ops each, {reprefill} chunk-states in all); "
        f"Spearman {judged.spearman:.2f}; default budget {calibration.budget:g}"
    )
    report: dict[str, Any] = {
        "ops": args.ops,
        "seeds": args.seeds,
        "calibration": calibration.to_json(),
        "held_samples": len(judged.pairs),
        "spearman": judged.spearman if judged.pairs else math.nan,
        "rows": rows,
    }
    show_and_save(table, report, None)
    if calibration.vouch_bounds:
        report["vouch"] = judge_vouching(calibration, held)
        vouch = Table(title="the plan-time bounds (no audit) on the same chunk-states")
        for column in ("ε", "bounded within ε", "truly over 3ε"):
            vouch.add_column(column, justify="right")
        for eps, row in report["vouch"].items():
            vouch.add_row(eps, str(row["within"]), f"{row['over']:.1%}")
        vouch.caption = f"the bounds serve within ε ≤ {calibration.vouch_budget:g} (the calibration's pick)"
        show_and_save(vouch, report, None)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
