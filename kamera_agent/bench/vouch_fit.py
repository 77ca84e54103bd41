"""Fitting the bounds a kept state is vouched for by without an audit, and judging them.

Why apart from the audit estimate's fit (`kamera_agent.bench.calibration_fit`): these bounds read
only what is known before any forward (`kamera_agent.fidelity.vouching`: a chunk's class and
its distance from the first approximated chunk), so they are fitted from the same measured steps
but judged on their own: the ops they would let stand, and on held-out episodes the share of
chunks they put within ε that measure over 3ε.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kamera_agent.errors import SettingsError
from kamera_agent.fidelity import AGREEMENT, BUDGETS, CLASSES, DISTANCES, Calibration

if TYPE_CHECKING:  # calibration_fit fits these bounds with the audit estimate: it imports this module
    from kamera_agent.bench.calibration_fit import Point, Slot, Step

__all__ = ["SHOWN", "Vouching", "fit_vouching", "judge_vouching", "vouch_pairs"]


@dataclass(frozen=True)
class Vouching:
    """What `fit_vouching` found: the bounds, the ε they may serve within and their frontier
    (per ε, as `Calibration.frontier`)."""

    bounds: dict[str, tuple[float, ...]]
    budget: float
    frontier: dict[str, dict[str, float]]


def vouch_pairs(slots: Sequence[Slot]) -> list[tuple[str, int, float]] | None:
    """``(class, distance, true error)`` of each approximated slot of one step (`Step.slots`),
    or ``None`` where the steps were saved before a slot's class was recorded."""
    out: list[tuple[str, int, float]] = []
    first: int | None = None
    for i, slot in enumerate(slots):
        if slot.exact:
            continue
        if slot.gone is None:
            return None
        first = i if first is None else first
        out.append((CLASSES[1] if slot.gone else CLASSES[0], i - first, slot.error))
    return out


def fit_vouching(steps: Sequence[Step], quantile: float) -> Vouching | None:
    """Per class, per distance, ``quantile`` of the approximated chunks' true errors, made
    non-increasing with distance (a bound holds for every farther chunk, where fewer samples
    lie); the default ε read off the ops those bounds let stand (`pick_budget`, as the audit
    estimate's, a point passing only where enough ops stand to show the agreement target:
    `SHOWN`); ``None`` where the steps did not record the classes."""
    from kamera_agent.bench.calibration_fit import floor_agreement, pick_budget

    found = [vouch_pairs(step.slots) for step in steps]
    per_step = [pairs for pairs in found if pairs is not None]
    if len(per_step) < len(found):
        return None
    errors: dict[str, list[list[float]]] = {kind: [[] for _ in range(DISTANCES)] for kind in CLASSES}
    for pairs in per_step:
        for kind, distance, error in pairs:
            errors[kind][min(distance, DISTANCES - 1)].append(error)
    bounds = {kind: _non_increasing(rows, quantile) for kind, rows in errors.items() if any(rows)}
    points = _frontier(bounds, steps, per_step)
    approximating = sum(1 for pairs in per_step if pairs)
    budget = pick_budget([_shown(point, approximating) for point in points], floor_agreement(steps))
    frontier = {
        f"{p.epsilon:g}": {"standing": p.standing, "agreement": p.agreement, "kl_mean": p.kl_mean}
        for p in points
    }
    return Vouching(bounds, budget, frontier)


SHOWN = math.ceil(1 / (1 - AGREEMENT))
"""The fewest standing ops whose agreement can show `AGREEMENT` (one flip among fewer is already
under it): a point the bounds let fewer stand at does not pass. Why stricter than the audit
estimate's pick: an engine serves what the bounds vouch for with no audit and no fix behind
it, so a point passed on a handful of ops would be the whole safeguard."""


def _shown(point: Point, approximating: int) -> Point:
    """``point``, failing where its standing ops (of ``approximating``) are too few to show the
    agreement target."""
    standing = round(point.standing * approximating)
    if 0 < standing < SHOWN:
        return replace(point, agreement=0.0)
    return point


def _non_increasing(rows: list[list[float]], quantile: float) -> tuple[float, ...]:
    """Each distance's quantile, raised to the largest quantile at any farther distance (an
    empty distance takes the next one's)."""
    out: list[float] = []
    running = 0.0
    for row in reversed(rows):
        if row:
            ordered = sorted(row)
            running = max(running, ordered[min(len(ordered) - 1, int(quantile * len(ordered)))])
        out.append(running)
    return tuple(reversed(out))


def _frontier(
    bounds: dict[str, tuple[float, ...]],
    steps: Sequence[Step],
    per_step: Sequence[list[tuple[str, int, float]]],
) -> list[Point]:
    """Per ε of `BUDGETS`, the approximating ops whose every approximated chunk's bound is within
    it (a chunk of a class with no bound is never), and how those answered."""
    from kamera_agent.bench.calibration_fit import standing_at

    return standing_at(
        [
            (max(_bound(bounds, kind, distance) for kind, distance, _ in pairs), step)
            for step, pairs in zip(steps, per_step, strict=True)
            if pairs
        ]
    )


def _bound(bounds: dict[str, tuple[float, ...]], kind: str, distance: int) -> float:
    row = bounds.get(kind)
    return row[min(distance, len(row) - 1)] if row else math.inf


def judge_vouching(calibration: Calibration, steps: Sequence[Step]) -> dict[str, dict[str, float]]:
    """Per ε of `BUDGETS`: how many approximated chunks of ``steps`` the calibration's bounds put
    within ε (``within``) and the share of those whose true error is over 3ε (``over``; NaN where
    none is within): the calibration target is at most 1 %."""
    pairs = []
    for step in steps:
        found = vouch_pairs(step.slots)
        if found is None:
            raise SettingsError(
                "these steps were saved before kept states' classes were recorded: run the episodes "
                "again (kamera calibrate MODEL --steps FILE)"
            )
        pairs += [(_bound(calibration.vouch_bounds, kind, d), error) for kind, d, error in found]
    out: dict[str, dict[str, float]] = {}
    for eps in BUDGETS:
        within = [error for bound, error in pairs if bound <= eps]
        over = sum(error > 3 * eps for error in within) / len(within) if within else math.nan
        out[f"{eps:g}"] = {"within": len(within), "over": over, "chunks": len(pairs)}
    return out
