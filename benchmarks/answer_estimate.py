"""Can the drift budget judge in answer units? How well what audits measure predicts the answer's KL.

Why: the budget bounds each approximated chunk's relative KV error (``scale × audit``, plus what
it inherits) by ε, but what a user sees is the answer. A repair that restores the tokens that
matter most to the answer (the head of a kept survivor, `slide_repair.py`) halves the answer's
KL while the KV error falls by a quarter, so a budget in KV units cannot credit it. Before the
budget is moved to answer units, this measures, on the steps ``kamera calibrate`` saved (each
op's chunks with their audits and true errors, and the answer's next-token KL against the fp32
re-prefill), how far KV-unit signals predict the KL, and what a budget that estimated the KL from
them would let stand against today's rule, fitted on the fitting episodes and judged on the
held-out ones.

Per op the answer-unit estimate is ``ratio(op kind) × Σ tokens × estimate² / window tokens``,
``estimate`` the chunk's KV-unit estimate (what a window knows: its audit, scaled, plus what it
inherits), ``ratio`` that op kind's ``--quantile`` of measured KL over the same sum on the
fitting episodes. Reads stored steps only (no model runs):

    .venv/bin/python benchmarks/answer_estimate.py --json docs/results/calibration/answer-estimate.json
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from kamera_agent.bench.calibration_fit import Step, _signals, _spearman, load_steps
from kamera_agent.bench.common import show_and_save
from kamera_agent.fidelity import BUDGETS, MEAN_KL, find_calibration

STEPS = Path(__file__).resolve().parents[1] / "docs" / "results" / "calibration"
MODELS = ("smollm2", "gemma3")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", default=str(STEPS), help="folder of <model>-steps.json and <model>-held-out-steps.json"
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--quantile", type=float, default=0.9, help="of KL over the KV-unit sum, per op kind")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    table = Table(title="Answer KL from KV-unit estimates (fitted on fitting episodes, judged on held-out)")
    for column in (
        "model",
        "ops picked by",
        "at today's ε",
        "ops standing",
        "first token",
        "KL mean",
        "KL > 3e-2",
    ):
        table.add_column(column)
    report: dict[str, Any] = {"quantile": args.quantile, "models": {}}
    for model in args.models:
        fit, info = load_steps(Path(args.steps) / f"{model}-steps.json")
        held, _ = load_steps(Path(args.steps) / f"{model}-held-out-steps.json")
        calibration = find_calibration(str(info["fingerprint"]))
        if calibration is None:
            raise SystemExit(f"no calibration filed for {model}'s fingerprint; run kamera calibrate")
        scale, inherit = calibration.scale, calibration.inherit
        ratios = _ratios(fit, scale, inherit, args.quantile)
        rows = _rows(held, scale, inherit, ratios)
        report["models"][model] = {
            "rank_correlation": _correlations(held, scale, inherit),
            "ratios": ratios,
            "default_epsilon": calibration.budget,
            "rows": rows,
        }
        for row in rows:
            table.add_row(
                model,
                row["rule"],
                f"{row['epsilon']:g}",
                f"{row['standing']:.0%}",
                f"{row['agreement']:.1%}",
                f"{row['kl_mean']:.1e}",
                f"{row['over']:.0%}",
            )
    return show_and_save(table, report, args.json)


def _approximating(steps: Sequence[Step], scale: float, inherit: float) -> list[tuple[Step, list[float]]]:
    """Each op that approximated a chunk, with its approximated chunks' KV-unit estimates."""
    out = []
    for step, pairs in zip(steps, _signals(steps, inherit), strict=True):
        if pairs:
            out.append((step, [scale * signal for signal, _ in pairs]))
    return out


def _energy(step: Step, estimates: list[float]) -> float:
    """``Σ tokens × estimate² / window tokens`` over the approximated chunks."""
    tokens = [slot.tokens for slot in step.slots if not slot.exact]
    return sum(n * e * e for n, e in zip(tokens, estimates, strict=True)) / sum(s.tokens for s in step.slots)


def _ratios(steps: Sequence[Step], scale: float, inherit: float, quantile: float) -> dict[str, float]:
    by_op: dict[str, list[float]] = {}
    for step, estimates in _approximating(steps, scale, inherit):
        energy = _energy(step, estimates)
        if energy > 0:
            by_op.setdefault(step.op, []).append(step.kl / energy)
    return {op: _quantile(values, quantile) for op, values in by_op.items()}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def _point(rule: str, epsilon: float | None, ops: int, standing: list[Step]) -> dict[str, Any]:
    return {
        "rule": rule,
        "epsilon": epsilon,
        "ops": ops,
        "standing": len(standing) / ops if ops else 0.0,
        "agreement": sum(s.agrees for s in standing) / len(standing) if standing else 1.0,
        "kl_mean": statistics.fmean(s.kl for s in standing) if standing else 0.0,
        "over": sum(s.kl > 3 * MEAN_KL for s in standing) / len(standing) if standing else 0.0,
    }


def _rows(
    steps: Sequence[Step], scale: float, inherit: float, ratios: dict[str, float]
) -> list[dict[str, Any]]:
    """At each ε of `BUDGETS`, the ops today's rule lets stand (every approximated chunk's
    estimate within ε), and as many ops again picked by each other key, lowest first: the
    answer-unit estimate, the true KV error (what a perfect audit would give) and the true KL
    (the best any estimate could do)."""
    ops = _approximating(steps, scale, inherit)
    keys = {
        "answer estimate": lambda step, est: ratios.get(step.op, math.inf) * _energy(step, est),
        "true KV error": lambda step, est: max(s.error for s in step.slots if not s.exact),
        "true KL": lambda step, est: step.kl,
    }
    rows = []
    for eps in BUDGETS:
        standing = [step for step, estimates in ops if max(estimates) <= eps]
        if not standing:
            continue
        rows.append(_point("KV estimate (today)", eps, len(ops), standing))
        for name, key in keys.items():
            ranked = sorted(ops, key=lambda pair: key(*pair))
            rows.append(_point(name, eps, len(ops), [step for step, _ in ranked[: len(standing)]]))
    return rows


def _correlations(steps: Sequence[Step], scale: float, inherit: float) -> dict[str, float]:
    """Spearman's rank correlation of each op's KL with its largest and its energy estimate."""
    ops = _approximating(steps, scale, inherit)
    kl = [step.kl for step, _ in ops]
    return {
        "largest": _spearman(kl, [max(estimates) for _, estimates in ops]),
        "energy": _spearman(kl, [_energy(step, estimates) for step, estimates in ops]),
    }


if __name__ == "__main__":
    main()
