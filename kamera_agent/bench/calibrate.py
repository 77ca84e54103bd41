"""Fitting a model's drift calibration (``kamera calibrate``) and judging one on other episodes.

Why from episodes of the window suite: the estimate a drift budget keeps (`kamera_agent.core.drift`)
must calibrate against what it stands for, each approximated chunk's relative KV error against
the model's own re-prefill of the window, on the approximations a window really makes. So the
window suite's episode runs with the policies unbounded (``drift_budget=None``), and after every
op each chunk the window does not hold exactly gets its true error (the re-prefill) and its
sampled audit, exactly as a budgeted window would audit it (same rows, same context).

A calibration is fitted on its own seeds (`FIT_SEEDS`) and judged on others (`HELD_SEEDS`,
``benchmarks/drift_estimator.py``); the window suite's episodes use neither.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.window_suite import _Episode, _items, text_frames
from kamera_agent.config import WindowConfig
from kamera_agent.core.drift import (
    AGREES,
    BUDGETS,
    CALIBRATION_DIR_VARIABLE,
    Calibration,
    audit_indices,
    find_calibration,
    relative_error,
    sampled_error,
    save_calibration,
)
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.errors import SettingsError
from kamera_agent.parsers.bench import add_calibrate_parser  # declared without torch: `kamera --help`
from kamera_agent.window import KameraWindow
from kamera_agent.window.budget import DriftBudget, Measure, shared_budget

__all__ = [
    "FIT_SEEDS",
    "HELD_SEEDS",
    "Judged",
    "Slot",
    "add_calibrate_parser",
    "calibrate",
    "drift_episode",
    "ensure_calibrated",
    "fit_calibration",
    "judge",
    "measure_fix_rates",
    "run_calibrate_command",
]

FIT_SEEDS = (7001, 7002)
"""Episodes ``kamera calibrate`` fits on by default."""

HELD_SEEDS = (7101, 7102)
"""Episodes a calibration is judged on by default (disjoint from `FIT_SEEDS`)."""

CAPACITY = 12


@dataclass(frozen=True)
class Slot:
    """One chunk of the window after one op: its true relative KV error against re-prefill, its
    own audit (0 where its KV is a forward's output over exactly its left context), and whether
    the window held it exactly (the chain up to it exact: never estimated, never fitted)."""

    error: float
    own: float
    exact: bool


def drift_episode(
    model: Any,
    seed: int,
    ops: int,
    progress: Progress,
    share: float = 0.1,
    *,
    texts: Sequence[Path] = (),
    **window: Any,
) -> list[list[Slot]]:
    """The window suite's episode (``seed``, ``ops``) with the policies unbounded; every op's
    chunks as `Slot`s. ``model`` and ``window`` are what `KameraWindow` takes; a text model's
    frames are passages of the corpus's calibration half, or of ``texts``."""
    config = WindowConfig(
        capacity_chunks=CAPACITY, max_new_tokens=1, evicted_pixels="keep", drift_budget=None
    )
    window_ = KameraWindow(model, config=config, **window)
    backend = window_.backend
    if not isinstance(backend, TransformersBackend):
        raise TypeError("calibration runs on a transformers model (it needs the model's own re-prefill)")
    measurer = DriftBudget(0.0, Calibration(backend.fingerprint, scale=1.0, inherit=0.0, audit_share=share))
    moves = _Episode(window_, backend.encoder, random.Random(seed), _items(ops))
    if backend.encoder.image_processor is None:  # a text model: random-token lines and pages instead
        moves.frames = text_frames(backend, seed, len(moves.frames), "calibration", texts)
    root = Context.root(backend.anchor.key)
    vision: dict[str, Any] = {}
    recorded: list[list[Slot]] = []
    task = progress.add_task(f"episode {seed}", total=ops)
    for _ in range(ops):
        moves.next().run()
        refs = window_.refs
        chunks = [window_.chunk(ref) for ref in refs]
        truth = backend.reference_prefill(chunks)
        kvs = [window_.chunk_kv(ref) for ref in refs]
        starts = [backend.anchor.advance]
        for chunk in chunks:
            starts.append(starts[-1] + chunk.advance)

        measure = _measure(backend, chunks, [truth.kv[0], *kvs], starts, share, vision)
        states = [window_.state_of(ref) for ref in refs]
        owns = measurer.estimates(states, root, measure)
        ctx, slots = root, []
        for state, own, kv, exact in zip(states, owns, kvs, truth.kv[1:], strict=True):
            ctx = ctx.extend(state)
            slots.append(Slot(relative_error(kv, exact), float(own or 0.0), ctx.exact))
        recorded.append(slots)
        progress.advance(task)
    window_.close()
    return recorded


def _measure(
    backend: TransformersBackend,
    chunks: Sequence[Any],
    placed: Sequence[Any],
    starts: Sequence[int],
    share: float,
    vision: dict[str, Any],
) -> Measure:
    """The audit a budgeted window runs (`kamera_agent.core.drift.audit`: the same rows, over the
    same context), on one op's window: ``placed`` is the anchor's KV, then each chunk's."""

    def measure(i: int, state: ChunkState, ctx: Context) -> float:
        chunk = chunks[i]
        features = None
        if chunk.has_vision:
            assert chunk.vision_key is not None
            if chunk.vision_key not in vision:
                vision[chunk.vision_key] = backend.encode_vision(chunk).features
            features = vision[chunk.vision_key]
        indices = audit_indices(chunk.num_tokens, share, f"{state.digest}:{ctx.digest}")
        kv = placed[i + 1]
        audited = backend.recompute(chunk, kv, indices, placed[: i + 1], starts[i], features).kv[0]
        return sampled_error(kv, audited, indices)

    return measure


def _signals(ops: Sequence[Sequence[Slot]], inherit: float) -> list[tuple[float, float]]:
    """``(own + inherit × largest signal to its left, true error)`` of every approximated chunk
    (an exact one's signal is 0, as a window's estimate of it)."""
    out = []
    for slots in ops:
        before = 0.0
        for slot in slots:
            signal = 0.0 if slot.exact else slot.own + inherit * before
            if not slot.exact:
                out.append((signal, slot.error))
            before = max(before, signal)
    return out


def fit_calibration(
    fingerprint: str,
    ops: Sequence[Sequence[Slot]],
    seeds: Sequence[int],
    share: float,
    inherit: float = 0.5,
    quantile: float = 0.99,
) -> Calibration:
    """The calibration of these episodes: the scale at which ``quantile`` of the approximated
    chunks have ``error ≤ scale × signal``, and the largest of `BUDGETS` at which at most 1 % of the
    chunks estimated within it were truly over `AGREES` (at least the smallest budget)."""
    pairs = _signals(ops, inherit)
    if not pairs:
        raise SettingsError(
            "nothing was approximated in these episodes: there is nothing to calibrate on; run longer "
            "episodes (--ops) or more of them (--seeds)"
        )
    ratios = sorted(error / max(signal, 1e-12) for signal, error in pairs)
    scale = ratios[min(len(ratios) - 1, int(quantile * len(ratios)))]
    draft = Calibration(fingerprint, scale, inherit, share, quantile, samples=len(pairs), seeds=tuple(seeds))
    judged = judge(draft, ops)
    budget = BUDGETS[0]
    for eps in BUDGETS:
        kept = [error for estimate, error in judged.pairs if estimate <= eps]
        if kept and sum(error > AGREES for error in kept) / len(kept) <= 0.01:
            budget = eps
    return Calibration(
        fingerprint,
        scale,
        inherit,
        share,
        quantile,
        budget,
        len(pairs),
        tuple(seeds),
        {f"{eps:g}": judged.over[eps] for eps in BUDGETS},
    )


@dataclass(frozen=True)
class Judged:
    """A calibration on episodes: each approximated chunk's ``(estimate, true error)``, their
    Spearman correlation, and per ε how many were estimated within it (``within``) and which share
    of those were truly over 3ε (``over``; NaN where none was within)."""

    pairs: list[tuple[float, float]]
    spearman: float
    within: dict[float, int]
    over: dict[float, float]


def judge(calibration: Calibration, ops: Sequence[Sequence[Slot]]) -> Judged:
    """How ``calibration``'s estimates stand against the true errors of these episodes."""
    pairs = [(calibration.scale * s, e) for s, e in _signals(ops, calibration.inherit)]
    within: dict[float, int] = {}
    over: dict[float, float] = {}
    for eps in (*BUDGETS, calibration.budget):
        kept = [error for estimate, error in pairs if estimate <= eps]
        within[eps] = len(kept)
        over[eps] = sum(error > 3 * eps for error in kept) / len(kept) if kept else math.nan
    estimates, errors = [p[0] for p in pairs], [p[1] for p in pairs]
    return Judged(pairs, _spearman(estimates, errors), within, over)


def _spearman(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return math.nan

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else math.nan


def episodes(
    model: Any,
    seeds: Sequence[int],
    ops: int,
    progress: Progress,
    share: float,
    *,
    texts: Sequence[Path] = (),
    **window: Any,
) -> list[list[Slot]]:
    """`drift_episode` for each seed, one after another, their ops together."""
    torch.manual_seed(0)
    out: list[list[Slot]] = []
    for seed in seeds:
        out += drift_episode(model, seed, ops, progress, share, texts=texts, **window)
    return out


def measure_fix_rates(
    model: Any,
    calibration: Calibration,
    seeds: Sequence[int],
    ops: int,
    progress: Progress,
    *,
    texts: Sequence[Path] = (),
    **window: Any,
) -> dict[str, tuple[int, int]]:
    """Per op name, ``(ops audited, ops that needed a fix)`` when the episodes of ``seeds`` run
    at the calibration's default budget with it: what a new window of this model starts from
    (`Calibration.fix_rates`), so it does not pay an audit and a fix to learn, op by op, what
    the fitting episodes already showed. Run on a budget of its own (the calibration filed in a
    scratch directory, found as any window finds it), never on a user's budget; every op's
    approximations tried (`DriftBudget.always_try`), so each rate is measured on all its ops."""
    config = WindowConfig(capacity_chunks=CAPACITY, max_new_tokens=1, evicted_pixels="keep")
    budget = shared_budget(calibration.fingerprint, calibration.budget, calibration)  # the windows' below
    before, budget.always_try = budget.outcomes(), True  # every op tried: its rate measured on all
    with tempfile.TemporaryDirectory(prefix="kamera-calibration-") as scratch:
        save_calibration(calibration, Path(scratch))
        user = os.environ.get(CALIBRATION_DIR_VARIABLE)
        os.environ[CALIBRATION_DIR_VARIABLE] = scratch
        try:
            for seed in seeds:
                window_ = KameraWindow(model, config=config, **window)
                assert window_.budget == calibration.budget  # found the scratch calibration
                moves = _Episode(window_, window_.encoder, random.Random(seed), _items(ops))
                if window_.encoder.image_processor is None:
                    backend = window_.backend
                    assert isinstance(backend, TransformersBackend)
                    moves.frames = text_frames(backend, seed, len(moves.frames), "calibration", texts)
                task = progress.add_task(f"fix rates {seed}", total=ops)
                for _ in range(ops):
                    moves.next().run()
                    progress.advance(task)
                window_.close()
        finally:
            budget.always_try = False
            if user is None:
                del os.environ[CALIBRATION_DIR_VARIABLE]
            else:
                os.environ[CALIBRATION_DIR_VARIABLE] = user
    after = budget.outcomes()
    return {
        op: (audited - before.get(op, (0, 0))[0], fixed - before.get(op, (0, 0))[1])
        for op, (audited, fixed) in after.items()
        if audited > before.get(op, (0, 0))[0]
    }


def calibrate(
    model: Any,
    seeds: Sequence[int],
    ops: int,
    progress: Progress,
    share: float = 0.1,
    quantile: float = 0.99,
    *,
    texts: Sequence[Path] = (),
    **window: Any,
) -> tuple[Calibration, list[list[Slot]]]:
    """Fit a model's calibration on the episodes of ``seeds`` (`fit_calibration`), then measure
    its fix rates at its default budget (`measure_fix_rates`); the calibration and its episodes.
    A text model reads passages of the corpus's calibration half, or of ``texts``."""
    fitted = episodes(model, seeds, ops, progress, share, texts=texts, **window)
    fingerprint = KameraWindow(model, config=WindowConfig(drift_budget=None), **window).backend.fingerprint
    calibration = fit_calibration(fingerprint, fitted, seeds, share, quantile=quantile)
    rates = measure_fix_rates(model, calibration, seeds, ops, progress, texts=texts, **window)
    return replace(calibration, fix_rates=rates), fitted


def ensure_calibrated(backend: TransformersBackend, progress: Progress, ops: int = 40) -> Calibration:
    """The model's calibration, fitted now on `FIT_SEEDS` (text or image episodes as it reads) and
    filed in the user's calibration directory where it has none: a benchmark's random-weight
    shape is a model like any other, and its default budget needs one."""
    found = find_calibration(backend.fingerprint)
    if found is not None:
        return found
    calibration, _ = calibrate(backend, FIT_SEEDS, ops, progress)
    save_calibration(calibration)
    return calibration


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_calibrate_command(args: Any, console: Any) -> int:
    """Fit and file the calibration; print where, its constants and how it stands on its episodes."""
    from rich.markup import escape
    from rich.table import Table

    if not 0 < args.audit <= 1 or not 0 < args.quantile < 1 or args.ops < 1:
        console.print("[red]--audit must be in (0, 1], --quantile in (0, 1) and --ops at least 1[/red]")
        return 2
    if args.model == "demo" and args.dtype is not None:
        console.print("[red]--dtype is for a checkpoint folder or a GGUF file; the demo runs in its own")
        return 2
    if args.model == "demo":
        from kamera_agent.demo.model import load_demo_model

        model, tokenizer, image_processor = load_demo_model()
        window: dict[str, Any] = {"tokenizer": tokenizer, "image_processor": image_processor}
    else:
        from kamera_agent.loading import load_backend

        model, window = load_backend(args.model, dtype=_DTYPES.get(args.dtype or "")), {}
    unreadable = [str(file) for file in args.texts if not Path(file).is_file()]
    if unreadable:
        console.print(f"[red]--texts: no such file: {escape(', '.join(unreadable))}")
        return 2
    began = time.perf_counter()
    try:
        with Progress(console=console, transient=True) as progress:
            calibration, ops = calibrate(
                model, args.seeds, args.ops, progress, args.audit, args.quantile, texts=args.texts, **window
            )
    except SettingsError as exc:
        console.print(f"[red]kamera calibrate: {escape(str(exc))}")
        return 2
    elapsed = time.perf_counter() - began
    path = save_calibration(calibration, Path(args.out) if args.out else None)
    judged = judge(calibration, ops)
    table = Table(
        title=f"drift calibration on {calibration.samples} approximated chunk-states (fitting episodes)"
    )
    for column in ("ε", "estimated within ε", "of those truly over 3ε"):
        table.add_column(column, justify="right")
    for eps in BUDGETS:
        table.add_row(f"{eps:g}", str(judged.within[eps]), f"{judged.over[eps]:.1%}")
    console.print(table)
    console.print(
        f"scale {calibration.scale:.3g}, inherit {calibration.inherit:g}, "
        f"audit {calibration.audit_share:.0%}; "
        f"Spearman {judged.spearman:.2f}; default budget ε = {calibration.budget:g}; filed at {path}"
    )
    rates = ", ".join(f"{op} {f}/{a}" for op, (a, f) in sorted(calibration.fix_rates.items()))
    console.print(f"at ε = {calibration.budget:g}, audited ops that needed a fix: {rates or 'none audited'}")
    console.print(
        f"calibrated in {int(elapsed // 60)} min {elapsed % 60:.0f} s ({len(args.seeds)} episodes of "
        f"{args.ops} ops, then as many at the chosen ε; {torch.get_num_threads()} torch thread(s))"
    )
    return 0
