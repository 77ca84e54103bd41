"""The two shapes every suite reports in: a `Grid` of formatted cells and a `Target` claim.

Why a module of their own: each suite builds its tables and checks its claims next to its own
figures (the agents suite in `kamera_agent.bench.agents`), while `report` and `results` gather
them all; keeping the shapes here lets both sides import them without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Grid", "Target", "num_cell", "percent_cell"]


def num_cell(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``, or "—" where it was not measured or is not finite."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return format(value, spec)


def percent_cell(value: float | None) -> str:
    """A share as a percentage with one decimal, or "—" where it was not measured."""
    return "—" if value is None else f"{100 * value:.1f} %"


@dataclass(frozen=True)
class Grid:
    """A titled table of formatted cells, with a note printed under it."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""


@dataclass(frozen=True)
class Target:
    """A claim the benchmark must show, the figure measured for it, and whether it holds.

    ``met`` is ``None`` when the run did not measure it (suite skipped, quick sizes, no items).
    """

    claim: str
    measured: str
    met: bool | None
