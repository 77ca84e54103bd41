"""What every suite of ``kamera bench`` shares: the options, timing, progress, machine facts.

Why one place: the suites are compared against each other and against other machines' runs,
so they must time the same way (median of repeats after a warm-up, measured side by side),
record the same facts about the machine, and read one validated options object.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.table import Table

from kamera_agent.baselines.clock import wall

__all__ = [
    "AGENT_NAMES",
    "HELD_OUT_SEED",
    "AgentName",
    "BenchOptions",
    "SuiteName",
    "finite",
    "machine_info",
    "median_seconds",
    "p90",
    "show_and_save",
    "wall",
]

SuiteName = Literal["fidelity", "cost", "window", "agents"]
AgentName = Literal["stream", "video", "web", "document"]
AGENT_NAMES: tuple[AgentName, ...] = ("stream", "video", "web", "document")
"""The agents suite's agents, in the order it runs them (`kamera_agent.bench.agents`)."""
HELD_OUT_SEED = 424242
"""Default item seed: training draws its item seeds from ``random.Random(0)``, evaluation its own."""

T = TypeVar("T")


class BenchOptions(BaseModel):
    """What one ``kamera bench`` run does.

    Attributes:
        suite: ``"fidelity"``, ``"cost"``, ``"window"``, ``"agents"`` or ``"all"``.
        model: a checkpoint folder or GGUF file (default: the shipped demo model).
        out: where results.json, report.md and the plots go.
        quick: small sizes everywhere (a smoke run: about a minute on 2 CPU cores).
        items: held-out fidelity items (default 1000; quick 24).
        ops: window-episode operations per frontier row (default 960: the frontier's 13 rows
            take about 20 minutes on 2 CPU cores; quick 12).
        rows: the window suite's frontier rows (`kamera_agent.bench.frontier.ROWS` names;
            empty: every row).
        agents: the agents suite's agents (default: all four; quick sizes with ``quick``).
        seed: the held-out item seed; the episode and the cost model derive theirs from it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    suite: Literal["fidelity", "cost", "window", "agents", "all"] = "all"
    model: Path | None = None
    out: Path = Path("bench-results")
    quick: bool = False
    items: int | None = Field(default=None, ge=1)
    ops: int | None = Field(default=None, ge=1)
    rows: tuple[str, ...] = ()
    agents: tuple[AgentName, ...] = AGENT_NAMES
    seed: int = HELD_OUT_SEED

    @property
    def suites(self) -> list[SuiteName]:
        return ["fidelity", "cost", "window", "agents"] if self.suite == "all" else [self.suite]

    @property
    def item_count(self) -> int:
        return self.items or (24 if self.quick else 1000)

    @property
    def op_count(self) -> int:
        return self.ops or (12 if self.quick else 960)

    @property
    def seeds(self) -> dict[str, int]:
        """Every seed the run uses, derived from one, so a run is reproducible from its record."""
        return {
            "items": self.seed,
            "episode": self.seed + 1,
            "cost_model": self.seed + 2,
            "agents": self.seed + 3,
        }


def median_seconds(fn: Callable[[], T], repeats: int, *, warmup: bool = True) -> tuple[float, T]:
    """Median wall seconds of ``fn`` over ``repeats`` calls (after an untimed warm-up call when
    asked: first calls pay allocator and kernel-selection costs), and the last result."""
    result = fn() if warmup else None
    samples = []
    for _ in range(max(1, repeats)):
        began = wall()
        result = fn()
        samples.append(wall() - began)
    assert result is not None
    return statistics.median(samples), result


def machine_info() -> dict[str, Any]:
    """The facts a timing needs to be read: platform, processor, cores, library versions, threads."""
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }


def p90(values: list[float]) -> float:
    """The 90th percentile (linear interpolation between order statistics); NaN when empty."""
    if not values:
        return math.nan
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def finite(value: float) -> float | None:
    """``value``, or ``None`` for NaN/inf: results.json stays strict JSON."""
    return value if math.isfinite(value) else None


def show_and_save(table: Table, report: dict[str, Any], path: str | None) -> dict[str, Any]:
    """Print a standalone benchmark's table and write its figures as JSON where ``path`` is
    given (the scripts' ``--json``); returns ``report``."""
    Console().print(table)
    if path:
        Path(path).write_text(json.dumps(report, indent=2))
    return report
