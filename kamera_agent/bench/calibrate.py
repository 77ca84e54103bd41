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
carried over from another model. The fix rates a new window starts from come from the same
episodes, so one pass over them is the whole calibration.

A calibration is fitted on its own seeds (`FIT_SEEDS`) and judged on others (`HELD_SEEDS`,
``benchmarks/drift_estimator.py``); the window suite's episodes use neither, and a text model's
passages come from the corpus's calibration half, disjoint from the benchmark half.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress, TaskID

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.window_suite import QUERY, TEXT_QUERY, _Episode, _items, text_frames
from kamera_agent.config import WindowConfig
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.errors import SettingsError
from kamera_agent.fidelity import (
    AGREEMENT,
    BUDGETS,
    MEAN_KL,
    Calibration,
    DriftBudget,
    Measure,
    audit_indices,
    find_calibration,
    relative_error,
    sampled_error,
    save_calibration,
)
from kamera_agent.metrics import next_token_kl
from kamera_agent.parsers.bench import add_calibrate_parser  # declared without torch: `kamera --help`
from kamera_agent.window import KameraWindow

__all__ = [
    "FIT_SEEDS",
    "HELD_SEEDS",
    "INHERITS",
    "RANKS",
    "Judged",
    "Point",
    "Slot",
    "Step",
    "add_calibrate_parser",
    "calibrate",
    "drift_episode",
    "ensure_calibrated",
    "fit_calibration",
    "frontier",
    "judge",
    "load_steps",
    "pick_budget",
    "run_calibrate_command",
    "save_steps",
]

FIT_SEEDS = (7001, 7002)
"""Episodes ``kamera calibrate`` fits on by default."""

HELD_SEEDS = (7101, 7102)
"""Episodes a calibration is judged on by default (disjoint from `FIT_SEEDS`)."""

CAPACITY = 12

_SETTLED = "push"
"""The op that moves no chunk: under a budget it adds to a window already held within ε, so its
fix rate on an unbounded episode (drift piled up by every earlier op) would misstate it."""


@dataclass(frozen=True)
class Slot:
    """One chunk of the window after one op: its true relative KV error against re-prefill, its
    own audit (0 where its KV is a forward's output over exactly its left context), and whether
    the window held it exactly (the chain up to it exact: never estimated, never fitted)."""

    error: float
    own: float
    exact: bool


@dataclass(frozen=True)
class Step:
    """One op of an episode: its name, the window's chunks after it, and how the window's first
    answer token to the suite's question compared with the re-prefill's."""

    op: str
    slots: tuple[Slot, ...]
    kl: float
    agrees: bool


def drift_episode(
    model: Any,
    seed: int,
    ops: int,
    progress: Progress,
    share: float = 0.1,
    *,
    task: TaskID | None = None,
    texts: Sequence[Path] = (),
    **window: Any,
) -> list[Step]:
    """The window suite's episode (``seed``, ``ops``) with the policies unbounded; every op as a
    `Step`. ``model`` and ``window`` are what `KameraWindow` takes; a text model's frames are
    passages of the corpus's calibration half, or of ``texts``. ``task`` (else one of its own)
    advances once per op."""
    config = WindowConfig(
        capacity_chunks=CAPACITY, max_new_tokens=1, evicted_pixels="keep", drift_budget=None
    )
    window_ = KameraWindow(model, config=config, **window)
    backend = window_.backend
    if not isinstance(backend, TransformersBackend):
        raise TypeError("calibration runs on a transformers model (it needs the model's own re-prefill)")
    measurer = DriftBudget(0.0, Calibration(backend.fingerprint, scale=1.0, inherit=0.0, audit_share=share))
    moves = _Episode(window_, backend.encoder, random.Random(seed), _items(ops))
    query = QUERY
    if backend.encoder.image_processor is None:  # a text model: passages of real text for frames
        moves.frames = text_frames(backend, seed, len(moves.frames), "calibration", texts)
        query = TEXT_QUERY
    query_ids = window_.query_ids(query)
    root = Context.root(backend.anchor.key)
    vision: dict[str, Any] = {}
    recorded: list[Step] = []
    if task is None:
        task = progress.add_task(f"episode {seed}", total=ops)
    for _ in range(ops):
        move = moves.next()
        move.run()
        refs = window_.refs
        chunks = [window_.chunk(ref) for ref in refs]
        truth = backend.reference_prefill(chunks, query_ids)
        answer = window_.ask(query, decode=DecodeConfig(max_new_tokens=1)).first_logits.float().cpu()
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
        agrees = int(answer.argmax()) == int(truth.logits.argmax())
        recorded.append(Step(move.op, tuple(slots), next_token_kl(truth.logits, answer), agrees))
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
    """The audit a budgeted window runs (`kamera_agent.fidelity.audit`: the same rows, over the
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


def _signals(steps: Sequence[Step], inherit: float) -> list[list[tuple[float, float]]]:
    """Per op, ``(own + inherit × largest signal to its left, true error)`` of each approximated
    chunk (an exact one's signal is 0, as a window's estimate of it)."""
    out = []
    for step in steps:
        before, pairs = 0.0, []
        for slot in step.slots:
            signal = 0.0 if slot.exact else slot.own + inherit * before
            if not slot.exact:
                pairs.append((signal, slot.error))
            before = max(before, signal)
        out.append(pairs)
    return out


@dataclass(frozen=True)
class Point:
    """The ops of some episodes at one ε (of those that approximated anything): the share the
    budget would let stand (every approximated chunk estimated within ε), and of those, the share
    whose first answer token was re-prefill's and their mean next-token KL (1 and 0 where none
    stands: nothing approximated is served)."""

    epsilon: float
    standing: float
    agreement: float
    kl_mean: float

    @property
    def answers_like_reprefill(self) -> bool:
        return self.agreement >= AGREEMENT and self.kl_mean <= MEAN_KL


def frontier(calibration: Calibration, steps: Sequence[Step]) -> list[Point]:
    """Per ε of `BUDGETS`, how the approximating ops of ``steps`` would stand under ``calibration``.
    Each op is judged on the window it left: an op whose every approximated chunk is estimated
    within ε is what a budgeted window serves as it is; one over ε is re-prefilled from there."""
    risks = _risks(calibration, steps)
    points = []
    for eps in BUDGETS:
        standing = [step for risk, step in risks if risk <= eps]
        agreement = statistics.fmean(s.agrees for s in standing) if standing else 1.0
        kl_mean = statistics.fmean(s.kl for s in standing) if standing else 0.0
        points.append(Point(eps, len(standing) / max(1, len(risks)), agreement, kl_mean))
    return points


def pick_budget(points: Sequence[Point]) -> float:
    """The default ε: the largest up to which every point's standing ops answered like a re-prefill
    (first answer token equal on at least `AGREEMENT` of them, mean KL at most `MEAN_KL`), else the
    smallest of `BUDGETS`. A larger ε lets more ops stand, so it is the cheapest point that
    passes; it stops at the first that fails, because ops let stand further out could dilute a
    failure into a passing mean."""
    picked = BUDGETS[0]
    for point in sorted(points, key=lambda point: point.epsilon):
        if not point.answers_like_reprefill:
            break
        picked = point.epsilon
    return picked


def _risks(calibration: Calibration, steps: Sequence[Step]) -> list[tuple[float, Step]]:
    """``(largest estimate among its approximated chunks, op)`` of every op that approximated."""
    out = []
    for step, pairs in zip(steps, _signals(steps, calibration.inherit), strict=True):
        if pairs:
            out.append((calibration.scale * max(signal for signal, _ in pairs), step))
    return out


def _fix_rates(calibration: Calibration, steps: Sequence[Step]) -> dict[str, tuple[int, int]]:
    """Per op name that moves chunks: ``(ops that approximated, those estimated over the budget)``."""
    rates: dict[str, tuple[int, int]] = {}
    for risk, step in _risks(calibration, steps):
        if step.op != _SETTLED:
            seen, over = rates.get(step.op, (0, 0))
            rates[step.op] = (seen + 1, over + int(risk > calibration.budget))
    return rates


INHERITS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)
"""The shares of the largest estimate to its left a chunk's estimate may inherit, fitted per model."""


RANKS = 0.8
"""The Spearman correlation with the true errors a fitted estimate must reach on its episodes
(where no share reaches it, every share is a candidate)."""


def fit_calibration(
    fingerprint: str,
    steps: Sequence[Step],
    seeds: Sequence[int],
    share: float,
    inherit: float | None = None,
    quantile: float = 0.99,
) -> Calibration:
    """The calibration of these episodes: for each share ``inherit`` of `INHERITS` (or the one
    given), the scale at which ``quantile`` of the approximated chunks have ``error ≤ scale ×
    signal``, its frontier and the default ε `pick_budget` reads off it; of the shares whose
    estimates rank the chunks' true errors (Spearman at least `RANKS`), the one whose default lets
    the most ops stand (the cheapest that still answers like a re-prefill; the smaller share on a
    tie), with each moving op's fix rate at its ε.

    Why the share is fitted: how much of an approximate context's error reaches the chunks after
    it differs between models, and a share too large for the model makes every chunk after the
    first approximated one look over ε. Why ranking is required: a large share lets more ops
    stand on the fitting episodes by making every estimate after a drifted chunk as large as
    its, so the estimate stops telling chunks apart (on SmolLM2 and Gemma 3 a share of 1 ranks
    the true errors at Spearman 0.01), and what it lets stand there is luck, not a measurement."""
    fits = [_fit(fingerprint, steps, seeds, share, each, quantile) for each in _shares(inherit)]
    ranked = [fit for fit in fits if judge(fit[0], steps).spearman >= RANKS] or fits
    best = max(ranked, key=lambda fit: (fit[1], -fit[0].inherit))[0]
    return replace(best, fix_rates=_fix_rates(best, steps))


def _shares(inherit: float | None) -> tuple[float, ...]:
    return INHERITS if inherit is None else (inherit,)


def _fit(
    fingerprint: str,
    steps: Sequence[Step],
    seeds: Sequence[int],
    share: float,
    inherit: float,
    quantile: float,
) -> tuple[Calibration, float]:
    """One share's calibration (without fix rates) and the share of ops its default lets stand."""
    pairs = [pair for op in _signals(steps, inherit) for pair in op]
    if not pairs:
        raise SettingsError(
            "nothing was approximated in these episodes: there is nothing to calibrate on; run longer "
            "episodes (--ops) or more of them (--seeds)"
        )
    ratios = sorted(error / max(signal, 1e-12) for signal, error in pairs)
    scale = ratios[min(len(ratios) - 1, int(quantile * len(ratios)))]
    draft = Calibration(fingerprint, scale, inherit, share, quantile, samples=len(pairs), seeds=tuple(seeds))
    points = frontier(draft, steps)
    judged = judge(draft, steps)
    picked = pick_budget(points)
    fitted = replace(
        draft,
        budget=picked,
        within={f"{eps:g}": judged.over[eps] for eps in BUDGETS},
        frontier={
            f"{p.epsilon:g}": {"standing": p.standing, "agreement": p.agreement, "kl_mean": p.kl_mean}
            for p in points
        },
    )
    standing = next(p.standing for p in points if p.epsilon == picked)
    return fitted, standing


@dataclass(frozen=True)
class Judged:
    """A calibration on episodes: each approximated chunk's ``(estimate, true error)``, their
    Spearman correlation, and per ε how many were estimated within it (``within``) and which share
    of those were truly over 3ε (``over``; NaN where none was within)."""

    pairs: list[tuple[float, float]]
    spearman: float
    within: dict[float, int]
    over: dict[float, float]


def judge(calibration: Calibration, steps: Sequence[Step]) -> Judged:
    """How ``calibration``'s estimates stand against the true errors of these episodes."""
    signals = [pair for op in _signals(steps, calibration.inherit) for pair in op]
    pairs = [(calibration.scale * s, e) for s, e in signals]
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
) -> list[Step]:
    """`drift_episode` for each seed, one after another, their ops together (one progress bar
    over all of them, with the time left)."""
    torch.manual_seed(0)
    task = progress.add_task("calibrating", total=len(seeds) * ops)
    out: list[Step] = []
    for n, seed in enumerate(seeds, start=1):
        progress.update(task, description=f"calibrating · episode {n} of {len(seeds)}")
        out += drift_episode(model, seed, ops, progress, share, task=task, texts=texts, **window)
    return out


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
) -> tuple[Calibration, list[Step]]:
    """Fit a model's calibration on the episodes of ``seeds`` (`fit_calibration`); the calibration
    and its episodes. A text model reads passages of the corpus's calibration half, or of ``texts``."""
    fitted = episodes(model, seeds, ops, progress, share, texts=texts, **window)
    fingerprint = KameraWindow(model, config=WindowConfig(drift_budget=None), **window).backend.fingerprint
    return fit_calibration(fingerprint, fitted, seeds, share, quantile=quantile), fitted


def save_steps(
    steps: Sequence[Step], path: Path, fingerprint: str, seeds: Sequence[int], share: float
) -> None:
    """Write what episodes measured, so a calibration can be fitted again (``--refit``) or checked
    against them without running the model."""
    rows = [[s.op, s.kl, s.agrees, [[x.error, x.own, x.exact] for x in s.slots]] for s in steps]
    data = {"fingerprint": fingerprint, "seeds": list(seeds), "audit_share": share, "steps": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":")))


def load_steps(path: Path) -> tuple[list[Step], dict[str, Any]]:
    """The steps `save_steps` wrote, and its other fields (fingerprint, seeds, audit share)."""
    data: dict[str, Any] = json.loads(path.read_text())
    steps = [
        Step(op, tuple(Slot(float(e), float(o), bool(x)) for e, o, x in slots), float(kl), bool(agrees))
        for op, kl, agrees, slots in data.pop("steps")
    ]
    return steps, data


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
        if args.refit is not None:
            ops, measured = load_steps(args.refit)
            fingerprint = KameraWindow(
                model, config=WindowConfig(drift_budget=None), **window
            ).backend.fingerprint
            if measured["fingerprint"] != fingerprint:
                console.print(f"[red]--refit: {escape(str(args.refit))} was measured on another model")
                return 2
            calibration = fit_calibration(
                fingerprint, ops, measured["seeds"], measured["audit_share"], quantile=args.quantile
            )
        else:
            with Progress(console=console, transient=True) as progress:
                calibration, ops = calibrate(
                    model,
                    args.seeds,
                    args.ops,
                    progress,
                    args.audit,
                    args.quantile,
                    texts=args.texts,
                    **window,
                )
    except SettingsError as exc:
        console.print(f"[red]kamera calibrate: {escape(str(exc))}")
        return 2
    elapsed = round(time.perf_counter() - began)
    if args.steps is not None:
        save_steps(ops, args.steps, calibration.fingerprint, calibration.seeds, calibration.audit_share)
    path = save_calibration(calibration, Path(args.out) if args.out else None)
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
        f"≥ {AGREEMENT:.0%} at mean KL ≤ {MEAN_KL:g}); filed at {path}"
    )
    rates = ", ".join(f"{op} {f}/{a}" for op, (a, f) in sorted(calibration.fix_rates.items()))
    console.print(f"at ε = {calibration.budget:g}, ops that approximated and needed a fix: {rates or 'none'}")
    console.print(
        f"calibrated in {elapsed // 60} min {elapsed % 60} s ({len(args.seeds)} episodes of "
        f"{args.ops} ops; {torch.get_num_threads()} torch thread(s))"
    )
    return 0
