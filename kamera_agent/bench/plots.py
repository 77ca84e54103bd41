"""PNG plots of a bench run, when matplotlib is installed (the optional ``[bench]`` extra).

Why optional: the tables carry every figure; plots are for reading trends (fidelity against
rank, speed-up against chunk length, cost accumulating over an episode or an agent's run). CI
does not install matplotlib, so a missing one is reported as a note, never an error.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from kamera_agent.bench.agents.plots import write_agent_plots
from kamera_agent.bench.cost import CostRun
from kamera_agent.bench.fidelity import RANKS, FidelityRun
from kamera_agent.bench.frontier import FrontierRun
from kamera_agent.bench.results import BenchResults
from kamera_agent.bench.window_suite import KAMERA, PREFIX

__all__ = ["plots_available", "write_plots"]

_RANKS = RANKS
_REFERENCES = ("blind", "cacheblend", "epic", "rank-16-deep", "orbit-16")


def plots_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write_plots(results: BenchResults, out: Path) -> list[Path]:
    """Write every plot the run has figures for; returns their paths (none without matplotlib)."""
    if not plots_available():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    makers: list[tuple[str, Any]] = []
    if results.fidelity is not None and results.fidelity.items_done:
        makers += [("accuracy_vs_rank.png", _accuracy), ("kl_vs_rank.png", _kl)]
    if results.cost is not None and results.cost.rows:
        makers.append(("ttft_ratio_vs_length.png", _ttft))
    if results.window is not None and any(run.records for run in results.window.runs):
        makers += [("episode_cumulative_cost.png", _episode), ("window_frontier.png", _frontier)]
    for name, maker in makers:
        figure = plt.figure(figsize=(6.4, 4.2))
        maker(figure, results)
        figure.tight_layout()
        figure.savefig(out / name, dpi=120)
        plt.close(figure)
        written.append(out / name)
    if results.agents is not None:
        written += write_agent_plots(results.agents, out, plt)
    return written


def _accuracy(figure: Any, results: BenchResults) -> None:
    run: FidelityRun = results.fidelity  # type: ignore[assignment]
    axes = figure.add_subplot()
    for label, read in (("multi-hop", "multi_hop_accuracy"), ("glyph (single-hop)", "glyph_accuracy")):
        axes.plot(
            _RANKS, [getattr(run.figure(f"rank-{m}"), read) for m in _RANKS], "o-", label=f"kamera, {label}"
        )
    for arm, style in (("reprefill", "k--"), ("blind", "r:"), ("cacheblend", "m-."), ("epic", "c-.")):
        axes.axhline(
            run.figure(arm).multi_hop_accuracy, color=style[0], linestyle=style[1:], label=f"{arm}, multi-hop"
        )
    axes.set(xscale="log", xlabel="patch rank", ylabel="accuracy", title="Accuracy vs patch rank")
    axes.set_ylim(-0.02, 1.02)
    _rank_axis(axes)


def _kl(figure: Any, results: BenchResults) -> None:
    run: FidelityRun = results.fidelity  # type: ignore[assignment]
    axes = figure.add_subplot()
    floor = 1e-18  # exact arms reach float rounding; keep them on a log axis
    axes.plot(_RANKS, [max(run.figure(f"rank-{m}").kl, floor) for m in _RANKS], "o-", label="kamera rank-m")
    for arm, colour in zip(_REFERENCES, ("r", "m", "c", "g", "y"), strict=True):
        axes.axhline(max(run.figure(arm).kl, floor), color=colour, linestyle=":", label=arm)
    axes.set(xscale="log", yscale="log", xlabel="patch rank", ylabel="next-token KL to re-prefill")
    axes.set_title("KL to re-prefill vs patch rank")
    _rank_axis(axes)


def _rank_axis(axes: Any) -> None:
    """Ticks at the ranks measured (no log-axis minor labels over them) and a small legend."""
    axes.set_xticks(_RANKS, [str(m) for m in _RANKS])
    axes.set_xticks([], minor=True)
    axes.legend(fontsize=7)


def _ttft(figure: Any, results: BenchResults) -> None:
    run: CostRun = results.cost  # type: ignore[assignment]
    axes = figure.add_subplot()
    lengths = [row.tokens for row in run.rows]
    axes.plot(lengths, [row.ratio for row in run.rows], "o-", label=f"rank-{run.shape.reuse_rank} reuse")
    axes.axhline(100, color="k", linestyle=":", label="100x target")
    axes.set(xscale="log", yscale="log", xlabel="chunk tokens", ylabel="re-prefill TTFT / reuse TTFT")
    axes.set_title("TTFT speed-up vs chunk length")
    axes.set_xticks(lengths, [str(n) for n in lengths])
    axes.set_xticks([], minor=True)
    axes.legend(fontsize=7)


def _episode(figure: Any, results: BenchResults) -> None:
    frontier: FrontierRun = results.window  # type: ignore[assignment]
    runs = [run for run in frontier.runs if run.records]
    shown = [run for run in runs if run.row in _EPISODE_ROWS] or runs[:1]
    tokens, seconds = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    for run in shown:
        steps = range(1, len(run.records) + 1)
        tokens.plot(steps, run.cumulative(KAMERA, "tokens"), label=f"kamera ({run.row})")
        seconds.plot(steps, [ms / 1e3 for ms in run.cumulative(KAMERA, "ms")], label=f"kamera ({run.row})")
    first = shown[0]
    steps = range(1, len(first.records) + 1)
    tokens.plot(steps, first.cumulative(PREFIX, "tokens"), "k--", label=PREFIX)
    seconds.plot(steps, [ms / 1e3 for ms in first.cumulative(PREFIX, "ms")], "k--", label=PREFIX)
    tokens.set(xlabel="op", ylabel="cumulative tokens prefilled", title="Prefilled tokens")
    seconds.set(xlabel="op", ylabel="cumulative seconds", title="Wall time")
    tokens.legend(fontsize=7)


_EPISODE_ROWS = ("exact", "defaults", "blind")


def _frontier(figure: Any, results: BenchResults) -> None:
    """Each row's mean and p90 KL to re-prefill after every op against the tokens it prefilled."""
    frontier: FrontierRun = results.window  # type: ignore[assignment]
    axes = figure.add_subplot()
    floor = 1e-12  # exact rows reach float rounding; keep them on a log axis
    for row in frontier.figures():
        mean, high = max(row.kl_mean, floor), max(row.kl_p90, floor)
        axes.errorbar(row.tokens, mean, yerr=[[0], [max(high - mean, 0.0)]], fmt="o", capsize=2)
        axes.annotate(row.row, (row.tokens, mean), fontsize=6, xytext=(3, 3), textcoords="offset points")
    axes.set(yscale="log", xlabel="tokens prefilled over the episode", ylabel="next-token KL to re-prefill")
    axes.set_title("Window frontier: mean KL after every op (bar to the 90th percentile)")
