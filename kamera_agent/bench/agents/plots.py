"""A plot per agent (cumulative wall time and tokens prefilled against step, every side), drawn
when matplotlib is installed; `kamera_agent.bench.plots` decides that and notes when it is not.

Why cumulative: an agent pays the sum over its window's life, and the curves show where each
side's cost comes from (a slide every frame, a replacement every step, a recall now and then).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kamera_agent.bench.agents.records import AgentsRun

__all__ = ["write_agent_plots"]

_STYLE = {"kamera": "-", "kamera-exact": "--", "prefix": ":"}


def write_agent_plots(suite: AgentsRun, out: Path, plt: Any) -> list[Path]:
    """``agent_<name>.png`` per agent with records: rows per model, columns wall time and tokens."""
    written = []
    for agent in suite.agents:
        runs = [run for run in suite.of_agent(agent) if run.records]
        if not runs:
            continue
        figure, axes = plt.subplots(len(runs), 2, figsize=(9.6, 3.4 * len(runs)), squeeze=False)
        for row, run in zip(axes, runs, strict=True):
            steps = range(1, len(run.records) + 1)
            for side in run.sides:
                style = _STYLE.get(side, "-")
                seconds = [ms / 1e3 for ms in run.cumulative(side, "ms")]
                row[0].plot(steps, seconds, style, label=side)
                row[1].plot(steps, run.cumulative(side, "tokens"), style, label=side)
            row[0].set(xlabel="step", ylabel="cumulative seconds", title=f"{agent} · {run.model}: wall time")
            row[1].set(
                xlabel="step", ylabel="cumulative tokens prefilled", title=f"{agent} · {run.model}: tokens"
            )
            row[0].legend(fontsize=7)
        figure.tight_layout()
        path = out / f"agent_{agent}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written
