"""The window suite's frontier: the same episode under every setting, one row per system.

Why a frontier and not one figure: the defaults trade exactness for forwards, and what they
trade shows only across the episode (KL after every op: mean, p90, worst; how often the first
answer token agrees with re-prefill) beside what they save (tokens, forwards, wall time). Each
row is one run of the same episode (same seed, same ops): the prefix cache (exact by
construction: its KL is measured too), `WindowConfig.exact()` (full rank), the defaults, blind
reuse (rank 0), every single-knob change of the defaults, and token recompute (`BlendCache`:
canonical reuse, the unchanged prefix kept, 5 to 60 % of every later chunk's tokens recomputed,
chosen by a one-layer deviation probe). Wall time is set against the prefix cache run beside
each row, in the same run, op by op.

More rows: a window setting is one more `Row`. A system that follows the window's lineup by
its own rule (e.g. token recompute: every chunk's canonical KV reused, the unchanged prefix
kept as a prefix cache keeps it, a fraction of the tokens of every chunk from the first changed
slot recomputed) is a `Follower` (`kamera_agent.bench.window_suite`): register it in
``FOLLOWERS`` and name it in a row's ``followers``; it becomes a row of its own with the same
columns, its wall time against the prefix cache of the run that hosted it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kamera_agent.bench.common import finite, p90
from kamera_agent.bench.floor import FLOORS
from kamera_agent.bench.window_suite import KAMERA, PREFIX, RECOMPUTE, WindowRun
from kamera_agent.config import FIDELITY_SETTINGS, WindowConfig

__all__ = ["CAPACITY", "ROWS", "FrontierRun", "Row", "RowFigures", "budgeted", "undercut"]

CAPACITY = 12
"""Chunks the episode's window holds (the oldest leave when it is full)."""


@dataclass(frozen=True)
class Row:
    """A window setting of the frontier.

    Attributes:
        name: the row's name in the table.
        overrides: the settings that differ from the base.
        exact: the base is `WindowConfig.exact` (else the defaults, `WindowConfig`).
        followers: the followers run beside it (`FOLLOWERS` names; the prefix cache first).
    """

    name: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    exact: bool = False
    followers: tuple[str, ...] = (PREFIX,)

    def config(self, capacity: int) -> WindowConfig:
        """The window's settings: pixels kept (the model's own re-prefill is rebuilt from them
        after every op, recalled frames included) and one-token answers."""
        base = WindowConfig.exact if self.exact else WindowConfig
        return base(capacity_chunks=capacity, max_new_tokens=1, evicted_pixels="retain", **self.overrides)

    @property
    def changed(self) -> str:
        """The settings that differ from the defaults, in words."""
        config, defaults = self.config(CAPACITY), WindowConfig(capacity_chunks=CAPACITY)
        differ = [
            f"{n}={getattr(config, n)}"
            for n in FIDELITY_SETTINGS
            if getattr(config, n) != getattr(defaults, n)
        ]
        return ", ".join(differ) or "the defaults"


def _rows(*rows: Row) -> Mapping[str, Row]:
    return MappingProxyType({row.name: row for row in rows})


_UNBOUNDED = {"drift_budget": None}

ROWS: Mapping[str, Row] = _rows(
    Row("exact", exact=True, followers=(PREFIX, *RECOMPUTE, *FLOORS)),
    Row("defaults"),
    Row("budget-1e-3", {"drift_budget": 1e-3}),
    Row("budget-1e-2", {"drift_budget": 1e-2}),
    Row("budget-3e-2", {"drift_budget": 3e-2}),
    Row("budget-1e-1", {"drift_budget": 1e-1}),
    Row("budget-2e-1", {"drift_budget": 2e-1}),
    Row("budget-3e-1", {"drift_budget": 3e-1}),
    Row("budget-5e-1", {"drift_budget": 5e-1}),
    Row("answer-1e-2", {"answer_budget": 1e-2}),
    Row("answer-3e-2", {"answer_budget": 3e-2}),
    Row("unbounded", _UNBOUNDED),
    Row("survivors-only", {"rank": "full", "orbit": False, "recall_context": "current", **_UNBOUNDED}),
    Row("blind", {"rank": 0, **_UNBOUNDED}),
    Row("rank-4", {"rank": 4, **_UNBOUNDED}),
    Row("rank-16", {"rank": 16, **_UNBOUNDED}),
    Row("rank-full", {"rank": "full", **_UNBOUNDED}),
    Row("survivors-removal", {"survivors": "removal", **_UNBOUNDED}),
    Row("recall-current", {"recall_context": "current", **_UNBOUNDED}),
    Row("orbit-off", {"orbit": False, **_UNBOUNDED}),
    Row("cascade-keep", {"cascade": "keep", **_UNBOUNDED}),
    Row("reorder-keep", {"reorder": "keep", **_UNBOUNDED}),
    Row("reorder-revert", {"reorder": "revert", **_UNBOUNDED}),
    Row("lazy", {"patch_mode": "lazy", **_UNBOUNDED}),
)
"""The frontier's window rows, in the order they run: exact (which hosts the token-recompute
sweep, `RECOMPUTE`, and the numerical floor, the same re-prefill in bf16 and fp16: `FLOORS`), the
defaults (the calibrated drift budget), the budget at the ε a calibration chooses among, the
budget in answer units (`WindowConfig.answer_budget`: next-token KL, no calibration), the
policies unbounded (the defaults before the budget: ``drift_budget=None``), survivors-only (the
one approximation kept survivors; every patch full rank and formed where its chunk stands),
blind, then each single-knob change of the unbounded policies."""


@dataclass(frozen=True)
class RowFigures:
    """One row of the frontier table, from the per-op records of the run(s) it comes from.

    Attributes:
        kl_mean, kl_p90, kl_max: next-token KL to re-prefill after every op.
        agreement: share of ops after which the first answer token agrees with re-prefill.
        max_logit_error: largest |logit difference| to re-prefill over every op.
        tokens, forwards, vision: totals over the episode.
        ms: the side's wall milliseconds over the episode (its ops only).
        prefix_ms: the prefix cache's beside it, in the same run.
        ask_ms, prefix_ask_ms: the questions' wall milliseconds (kamera: placing what changed
            and the query's forward; the prefix cache: the query's forward).
        ops: ops measured.
    """

    row: str
    changed: str
    ops: int
    kl_mean: float
    kl_p90: float
    kl_max: float
    agreement: float
    max_logit_error: float
    tokens: float
    forwards: float
    vision: float
    ms: float
    prefix_ms: float
    ask_ms: float
    prefix_ask_ms: float

    @property
    def wall_ratio(self) -> float:
        """The side's wall time over the prefix cache's in the same run (ops only; < 1: faster)."""
        return self.ms / self.prefix_ms if self.prefix_ms > 0 else math.nan

    @property
    def wall_ratio_with_asks(self) -> float:
        """The same with every op's question added on both sides."""
        ours, theirs = self.ms + self.ask_ms, self.prefix_ms + self.prefix_ask_ms
        return ours / theirs if theirs > 0 else math.nan

    @classmethod
    def of(cls, row: str, changed: str, runs: list[WindowRun], side: str) -> RowFigures:
        kl = [value for run in runs for value in run.values(side, "kl")]
        agrees = [value for run in runs for value in run.values(side, "agrees")]
        errors = [value for run in runs for value in run.values(side, "logit_error")]
        first = runs[0]  # a follower's work is the same in every run: its cost from the first

        def total(name: str, who: str = side) -> float:
            return first.total(who, name)

        return cls(
            row,
            changed,
            len(kl),
            statistics.fmean(kl) if kl else math.nan,
            p90(kl),
            max(kl, default=math.nan),
            statistics.fmean(agrees) if agrees else math.nan,
            max(errors, default=math.nan),
            total("tokens"),
            total("forwards"),
            total("vision"),
            total("ms"),
            total("ms", PREFIX),
            total("ask_ms"),
            total("ask_ms", PREFIX),
        )

    def to_json(self) -> dict[str, Any]:
        out = {
            name: finite(value) if isinstance(value, float) else value for name, value in vars(self).items()
        }
        out["wall_ratio"] = finite(self.wall_ratio)
        out["wall_ratio_with_asks"] = finite(self.wall_ratio_with_asks)
        return out


@dataclass
class FrontierRun:
    """The suite's live state: its sizes, then a `WindowRun` per row as each starts."""

    seed: int
    ops_requested: int
    capacity: int = CAPACITY
    rows: tuple[str, ...] = tuple(ROWS)
    runs: list[WindowRun] = field(default_factory=list)
    seconds: float = 0.0
    content: str = "the demo task's legend frames and pages"
    """What the episode pushes (a text model: passages of real text)."""

    def figures(self) -> list[RowFigures]:
        """The table's rows: the prefix cache first (pooled over every run beside which it ran:
        its KL from every op of each, its cost and wall from the first run), then each window
        row, then each other follower."""
        runs = [run for run in self.runs if run.records]
        if not runs:
            return []
        out = [RowFigures.of(PREFIX, "crop at the first change, re-prefill the rest", runs, PREFIX)]
        out += [RowFigures.of(run.row, run.changed, [run], KAMERA) for run in runs]
        out += [
            RowFigures.of(name, _follower_says(name, run.row), [run], name)
            for run in runs
            for name in run.followers
            if name != PREFIX
        ]
        return out

    def find(self, row: str) -> WindowRun | None:
        return next((run for run in self.runs if run.row == row), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "ops_requested": self.ops_requested,
            "capacity_chunks": self.capacity,
            "rows_requested": list(self.rows),
            "content": self.content,
            "seconds": self.seconds,
            "frontier": [row.to_json() for row in self.figures()],
            "runs": [run.to_json() for run in self.runs],
        }


def budgeted(row: str) -> bool:
    """A row the drift budget decides: the defaults (the calibrated ε) or the budget at one ε, in
    KV or in answer units."""
    return row == "defaults" or row.startswith(("budget-", "answer-"))


def undercut(frontier: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Where the budget is off the frontier: pairs (budget row, other row) in which the other
    answers with the re-prefill's first token on at least as many ops for fewer prefilled tokens.
    ``frontier`` is a stored run's table (`FrontierRun.to_json`'s ``frontier``); the floors are no
    system (their tokens are a re-prefill's)."""
    others = [row for row in frontier if not budgeted(row["row"]) and row["row"] not in FLOORS]
    return [
        (mine["row"], other["row"])
        for mine in frontier
        if budgeted(mine["row"])
        for other in others
        if other["agreement"] >= mine["agreement"] and other["tokens"] < mine["tokens"]
    ]


def _follower_says(name: str, row: str) -> str:
    if name in FLOORS:
        return (
            f"the same re-prefill in {str(FLOORS[name]).removeprefix('torch.')}, beside {row}: its KL and "
            "top-1 are the model's numerical floor; its wall is not a cost"
        )
    return f"beside {row}"
