"""Fitting a drift calibration to what episodes measured, and judging one on other episodes.

Why apart from running the episodes (`kamera_agent.bench.calibration_episodes`): fitting reads
only the measured steps, never the model, so a calibration can be fitted again from a saved run
(``kamera calibrate --refit``) or judged on held-out episodes by the same functions.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kamera_agent.bench.vouch_fit import fit_vouching
from kamera_agent.errors import SettingsError
from kamera_agent.fidelity import AGREEMENT, BUDGETS, MEAN_KL, Calibration

__all__ = [
    "INHERITS",
    "RANKS",
    "Judged",
    "Point",
    "Slot",
    "Step",
    "fit_calibration",
    "frontier",
    "judge",
    "load_steps",
    "pick_budget",
    "save_steps",
    "standing_at",
]

_SETTLED = "push"
"""The op that moves no chunk: under a budget it adds to a window already held within ε, so its
fix share on an unbounded episode (drift piled up by every earlier op) would misstate it."""


@dataclass(frozen=True)
class Slot:
    """One chunk of the window after one op: its true relative KV error against re-prefill, its
    own audit (0 where its KV is a forward's output over exactly its left context), whether
    the window held it exactly (the chain up to it exact: never estimated, never fitted), and
    its tokens (what re-prefilling it costs; 1 in steps saved before they were recorded) and
    whether its KV encodes a chunk no longer in the window (`kamera_agent.fidelity.absorbed_gone`;
    ``None`` in steps saved before it was recorded)."""

    error: float
    own: float
    exact: bool
    tokens: int = 1
    gone: bool | None = None


@dataclass(frozen=True)
class Step:
    """One op of an episode: its name, the window's chunks after it, how the window's first
    answer token to the suite's question compared with the re-prefill's, and whether the model's
    own re-prefill in bf16 gave the fp32 one's (the numerical floor; ``None`` in steps saved
    before it was recorded)."""

    op: str
    slots: tuple[Slot, ...]
    kl: float
    agrees: bool
    floor_agrees: bool | None = None


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

    def answers_like_reprefill(self, floor: float | None = None) -> bool:
        """First token equal on at least `AGREEMENT` of the ops let stand, and on no fewer than
        the model's own bf16 re-prefill kept (``floor``), at mean KL at most `MEAN_KL`."""
        return self.agreement >= max(AGREEMENT, floor or 0.0) and self.kl_mean <= MEAN_KL


def floor_agreement(steps: Sequence[Step]) -> float | None:
    """The share of the ops on which the model's own bf16 re-prefill gave the fp32 one's first
    token (``None``: not recorded): the agreement a deployment in bf16 already accepts."""
    floors = [step.floor_agrees for step in steps if step.floor_agrees is not None]
    return statistics.fmean(floors) if floors else None


def frontier(calibration: Calibration, steps: Sequence[Step]) -> list[Point]:
    """Per ε of `BUDGETS`, how the approximating ops of ``steps`` would stand under ``calibration``.
    Each op is judged on the window it left: an op whose every approximated chunk is estimated
    within ε is what a budgeted window serves as it is; one over ε is re-prefilled from there."""
    return standing_at(_risks(calibration, steps))


def standing_at(risks: Sequence[tuple[float, Step]]) -> list[Point]:
    """Per ε of `BUDGETS`, the ops whose risk (their largest approximated chunk's estimate) is
    within it, and how those answered."""
    points = []
    for eps in BUDGETS:
        standing = [step for risk, step in risks if risk <= eps]
        agreement = statistics.fmean(s.agrees for s in standing) if standing else 1.0
        kl_mean = statistics.fmean(s.kl for s in standing) if standing else 0.0
        points.append(Point(eps, len(standing) / max(1, len(risks)), agreement, kl_mean))
    return points


def pick_budget(points: Sequence[Point], floor: float | None = None) -> float:
    """The default ε: the largest up to which every point's standing ops answered like a re-prefill
    (first answer token equal on at least `AGREEMENT` of them and on no fewer than the model's
    ``floor``, mean KL at most `MEAN_KL`), else the smallest of `BUDGETS`. A larger ε lets more
    ops stand, so it is the cheapest point that passes; it stops at the first that fails, because
    ops let stand further out could dilute a failure into a passing mean."""
    picked = BUDGETS[0]
    for point in sorted(points, key=lambda point: point.epsilon):
        if not point.answers_like_reprefill(floor):
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


def _fix_shares(calibration: Calibration, steps: Sequence[Step]) -> dict[str, tuple[int, float]]:
    """Per op name that moves chunks: ``(ops that approximated, their fix shares summed)`` at the
    default ε (`_fix_share`)."""
    shares: dict[str, tuple[int, float]] = {}
    for step, pairs in zip(steps, _signals(steps, calibration.inherit), strict=True):
        if pairs and step.op != _SETTLED:
            seen, spent = shares.get(step.op, (0, 0.0))
            shares[step.op] = (seen + 1, spent + _fix_share(calibration, step))
    return shares


def _fix_share(calibration: Calibration, step: Step) -> float:
    """The share of re-prefilling from the op's first approximated chunk to the end that the
    budget's fixes spend on the window the op left: left to right, each chunk estimated over ε is
    re-prefilled alone over its left, after which it carries only what it inherits (always within
    ε: what it inherits is a share of an estimate within ε).

    Why this is an estimate: after a chunk is re-prefilled, a window audits the chunks after it
    again over their new left context; the episodes measured each chunk's audit over the left
    context the op left, so a chunk after a re-prefilled one is judged on that audit."""
    scale, eps, inherit = calibration.scale, calibration.budget, calibration.inherit
    first = next(i for i, slot in enumerate(step.slots) if not slot.exact)
    before, spent = 0.0, 0
    for slot in step.slots[first:]:
        signal = 0.0 if slot.exact else slot.own + inherit * before
        if scale * signal > eps:
            signal, spent = inherit * before, spent + slot.tokens
        before = max(before, signal)
    return spent / sum(slot.tokens for slot in step.slots[first:])


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
    tie), with each moving op's fix share at its ε.

    Why the share is fitted: how much of an approximate context's error reaches the chunks after
    it differs between models, and a share too large for the model makes every chunk after the
    first approximated one look over ε. Why ranking is required: a large share lets more ops
    stand on the fitting episodes by making every estimate after a drifted chunk as large as
    its, so the estimate stops telling chunks apart, and what it lets stand there is luck, not a
    measurement."""
    fits = [_fit(fingerprint, steps, seeds, share, each, quantile) for each in _shares(inherit)]
    ranked = [fit for fit in fits if judge(fit[0], steps).spearman >= RANKS] or fits
    best = max(ranked, key=lambda fit: (fit[1], -fit[0].inherit))[0]
    best = replace(best, fix_shares=_fix_shares(best, steps))
    vouching = fit_vouching(steps, quantile)
    if vouching is None:  # steps saved before kept states' classes were recorded
        return best
    return replace(
        best, vouch_bounds=vouching.bounds, vouch_budget=vouching.budget, vouch_frontier=vouching.frontier
    )


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
    """One share's calibration (without fix shares) and the share of ops its default lets stand."""
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
    floor = floor_agreement(steps)
    picked = pick_budget(points, floor)
    fitted = replace(
        draft,
        budget=picked,
        floor=floor,
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
        within_eps = [error for estimate, error in pairs if estimate <= eps]
        within[eps] = len(within_eps)
        over[eps] = sum(error > 3 * eps for error in within_eps) / len(within_eps) if within_eps else math.nan
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


def save_steps(
    steps: Sequence[Step], path: Path, fingerprint: str, seeds: Sequence[int], share: float
) -> None:
    """Write what episodes measured, so a calibration can be fitted again (``--refit``) or checked
    against them without running the model."""
    rows = [[s.op, s.kl, s.agrees, [_row(x) for x in s.slots], *_floor(s)] for s in steps]
    data = {"fingerprint": fingerprint, "seeds": list(seeds), "audit_share": share, "steps": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":")))


def load_steps(path: Path) -> tuple[list[Step], dict[str, Any]]:
    """The steps `save_steps` wrote, and its other fields (fingerprint, seeds, audit share)."""
    data: dict[str, Any] = json.loads(path.read_text())
    steps = [
        Step(op, tuple(_slot(*slot) for slot in slots), float(kl), bool(agrees), *map(bool, floor))
        for op, kl, agrees, slots, *floor in data.pop("steps")
    ]
    return steps, data


def _floor(step: Step) -> list[bool]:
    return [] if step.floor_agrees is None else [step.floor_agrees]


def _row(slot: Slot) -> list[Any]:
    row: list[Any] = [slot.error, slot.own, slot.exact, slot.tokens]
    return row if slot.gone is None else [*row, slot.gone]


def _slot(error: float, own: float, exact: bool, tokens: int = 1, gone: bool | None = None) -> Slot:
    return Slot(float(error), float(own), bool(exact), int(tokens), None if gone is None else bool(gone))
