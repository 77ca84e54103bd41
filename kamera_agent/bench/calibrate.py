"""Fitting a model's drift calibration (``kamera calibrate``) and judging one on other episodes.

Why from episodes of the window suite: the estimate a drift budget keeps (`kamera_agent.fidelity`)
must calibrate against what it stands for, each approximated chunk's relative KV error against
the model's own re-prefill of the window, on the approximations a window really makes. So the
window suite's episode runs with the policies unbounded (``drift_budget=None``), and after every
op each chunk the window does not hold exactly gets its true error (the re-prefill) and its
sampled audit, exactly as a budgeted window would audit it (same rows, same context).

Why the answer too: an error in KV units says nothing by itself about what a model answers, and
models differ in how much of it they shrug off. So after every op the window also answers the
suite's question, and its first answer token is compared with the re-prefill's (the same forward,
the question appended). The default ε is then picked from that measured frontier (`pick_budget`):
the largest at which the ops the budget would let stand answered like a re-prefill. Nothing is
carried over from another model. The fix shares a new window starts from come from the same
episodes, so one pass over them is the whole calibration.

A calibration is fitted on its own seeds (`FIT_SEEDS`) and judged on others (`HELD_SEEDS`,
``benchmarks/drift_estimator.py``); the window suite's episodes use neither, and a text model's
passages come from the corpus's calibration half, disjoint from the benchmark half.

The episodes run in `kamera_agent.bench.calibration_episodes`, the fitting and judging in
`kamera_agent.bench.calibration_fit`; this module is the command and its report.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from kamera_agent.bench.calibration_episodes import calibrate
from kamera_agent.bench.calibration_fit import Step, fit_calibration, judge, load_steps, save_steps
from kamera_agent.bench.progress import make_progress
from kamera_agent.config import WindowConfig
from kamera_agent.errors import SettingsError
from kamera_agent.fidelity import AGREEMENT, BUDGETS, MEAN_KL, Calibration, save_calibration
from kamera_agent.window import KameraWindow

__all__ = ["run_calibrate_command"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_calibrate_command(args: Any, console: Any) -> int:
    """Fit and file the calibration; print where, its constants and how it stands on its episodes."""
    from rich.markup import escape

    refused = _refused(args)
    if refused is not None:
        console.print(f"[red]{escape(refused)}")
        return 2
    if args.model == "demo":
        from kamera_agent.demo.model import load_demo_model

        model, tokenizer, image_processor = load_demo_model()
        window: dict[str, Any] = {"tokenizer": tokenizer, "image_processor": image_processor}
    else:
        from kamera_agent.loading import load_backend

        model, window = load_backend(args.model, dtype=_DTYPES.get(args.dtype or "")), {}
    began = time.perf_counter()
    try:
        fitted = _fitted(args, console, model, window)
    except SettingsError as exc:
        console.print(f"[red]kamera calibrate: {escape(str(exc))}")
        return 2
    if fitted is None:
        console.print(f"[red]--refit: {escape(str(args.refit))} was measured on another model")
        return 2
    calibration, ops = fitted
    elapsed = round(time.perf_counter() - began)
    if args.steps is not None:
        save_steps(ops, args.steps, calibration.fingerprint, calibration.seeds, calibration.audit_share)
    path = save_calibration(calibration, Path(args.out) if args.out else None)
    _report(console, calibration, ops, path)
    console.print(
        f"calibrated in {elapsed // 60} min {elapsed % 60} s ({len(args.seeds)} episodes of "
        f"{args.ops} ops; {torch.get_num_threads()} torch thread(s))"
    )
    return 0


def _refused(args: Any) -> str | None:
    """What is wrong with the command's arguments, before any model is loaded (``None``: nothing)."""
    if not 0 < args.audit <= 1 or not 0 < args.quantile < 1 or args.ops < 1:
        return "--audit must be in (0, 1], --quantile in (0, 1) and --ops at least 1"
    if args.model == "demo" and args.dtype is not None:
        return "--dtype is for a checkpoint folder or a GGUF file; the demo runs in its own"
    unreadable = [str(file) for file in args.texts if not Path(file).is_file()]
    if unreadable:
        return f"--texts: no such file: {', '.join(unreadable)}"
    return None


def _fitted(
    args: Any, console: Any, model: Any, window: dict[str, Any]
) -> tuple[Calibration, list[Step]] | None:
    """The calibration and the steps it was fitted on: refitted from saved steps (``None``: they
    were measured on another model), else fitted on new episodes."""
    if args.refit is None:
        with make_progress(console, transient=True) as progress:
            return calibrate(
                model, args.seeds, args.ops, progress, args.audit, args.quantile, texts=args.texts, **window
            )
    ops, measured = load_steps(args.refit)
    fingerprint = KameraWindow(model, config=WindowConfig(drift_budget=None), **window).backend.fingerprint
    if measured["fingerprint"] != fingerprint:
        return None
    seeds, share = measured["seeds"], measured["audit_share"]
    return fit_calibration(fingerprint, ops, seeds, share, quantile=args.quantile), ops


def _report(console: Any, calibration: Calibration, ops: list[Step], path: Path) -> None:
    """The calibration's frontier on its own episodes, its constants and where it was filed."""
    from rich.table import Table

    judged = judge(calibration, ops)
    table = Table(
        title=f"drift calibration on {len(ops)} ops, {calibration.samples} approximated chunk-states "
        "(fitting episodes)"
    )
    columns = (
        "ε",
        "ops let stand",
        "first token as re-prefill",
        "mean KL",
        "chunks estimated within ε",
        "of those truly over 3ε",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for eps in BUDGETS:
        point = calibration.frontier[f"{eps:g}"]
        mark = " ←" if eps == calibration.budget else ""
        table.add_row(
            f"{eps:g}{mark}",
            f"{point['standing']:.0%}",
            f"{point['agreement']:.1%}",
            f"{point['kl_mean']:.2g}",
            str(judged.within[eps]),
            f"{judged.over[eps]:.1%}",
        )
    console.print(table)
    console.print(
        f"scale {calibration.scale:.3g}, inherit {calibration.inherit:g}, "
        f"audit {calibration.audit_share:.0%}; Spearman {judged.spearman:.2f}; default budget "
        f"ε = {calibration.budget:g} (the largest whose ops let stand kept the first token on "
        f"≥ {AGREEMENT:.0%}{_floor_said(calibration.floor)} at mean KL ≤ {MEAN_KL:g}); filed at {path}"
    )
    shares = ", ".join(
        f"{op} {spent / ops:.0%} over {ops}" for op, (ops, spent) in sorted(calibration.fix_shares.items())
    )
    console.print(
        f"at ε = {calibration.budget:g}, the share of re-prefilling from its first approximated chunk "
        f"an op's fixes spend: {shares or 'none'}"
    )


def _floor_said(floor: float | None) -> str:
    """The bf16 floor beside the agreement target, where the episodes measured it."""
    return "" if floor is None else f" and ≥ the model's own bf16 re-prefill's {floor:.1%}"
