"""``kamera bench`` and ``kamera calibrate``: their arguments (run by `kamera_agent.bench`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kamera_agent.parsers import add_chat_template, add_command, positive

__all__ = [
    "AGENTS",
    "DTYPES",
    "FIT_SEEDS",
    "FRONTIER_ROWS",
    "HELD_OUT_SEED",
    "SUITES",
    "add_bench_parser",
    "add_calibrate_parser",
]

SUITES = ("fidelity", "cost", "window", "agents", "agents-replay", "all")
"""``--suite`` choices (`kamera_agent.bench.common.BenchOptions`)."""
FRONTIER_ROWS = (
    "exact",
    "defaults",
    "budget-1e-3",
    "budget-1e-2",
    "budget-3e-2",
    "budget-1e-1",
    "budget-2e-1",
    "budget-3e-1",
    "budget-5e-1",
    "answer-1e-2",
    "answer-3e-2",
    "unbounded",
    "survivors-only",
    "blind",
    "rank-4",
    "rank-16",
    "rank-full",
    "survivors-removal",
    "recall-current",
    "orbit-off",
    "cascade-keep",
    "reorder-keep",
    "reorder-revert",
    "lazy",
)
"""The window suite's frontier rows, in order (`kamera_agent.bench.frontier.ROWS`)."""
AGENTS = ("stream", "video", "web", "document")
"""The agents suite's agents (`kamera_agent.bench.common.AGENT_NAMES`)."""
HELD_OUT_SEED = 424242
"""The default item seed (`kamera_agent.bench.common.HELD_OUT_SEED`)."""
FIT_SEEDS = (7001, 7002)
"""Episodes a calibration is fitted on (`kamera_agent.bench.calibration_episodes.FIT_SEEDS`)."""
DTYPES = ("bfloat16", "float16", "float32")
"""``calibrate --dtype`` choices."""


def add_bench_parser(commands: Any) -> None:
    """Register ``bench`` on the ``kamera`` command's subparsers."""
    bench = add_command(
        commands,
        "bench",
        "fidelity, cost, window and agent benchmarks, with a report",
        "Run the benchmark suites on the shipped demo model (or a checkpoint): answers under reuse "
        "against re-prefill, time to first token, a long agent episode under every setting, and "
        "four agents against a prefix cache. Writes results.json, report.md and plots to --out.",
    )
    bench.add_argument(
        "--suite",
        choices=SUITES,
        default="all",
        help="which suite to run (agents-replay, which drives kamera serve, runs alone)",
    )
    bench.add_argument(
        "--model",
        default=None,
        help="a checkpoint folder or GGUF file (default: the shipped demo model; a text model runs --suite "
        "window, agents, agents-replay and cost over real text)",
    )
    add_chat_template(bench, "agents-replay, as kamera serve takes it: ")
    bench.add_argument("--out", default="bench-results", help="output directory")
    bench.add_argument("--quick", action="store_true", help="small sizes: a smoke run of about a minute")
    bench.add_argument("--items", type=positive, default=None, help="fidelity items (default 1000)")
    bench.add_argument(
        "--ops", type=positive, default=None, help="window suite: episode ops per frontier row (default 960)"
    )
    bench.add_argument(
        "--rows",
        nargs="+",
        choices=FRONTIER_ROWS,
        default=[],
        metavar="ROW",
        help=f"window suite: which frontier rows (default: all: {', '.join(FRONTIER_ROWS)})",
    )
    bench.add_argument(
        "--agents", nargs="+", choices=AGENTS, default=list(AGENTS), help="agents suite: which agents"
    )
    bench.add_argument(
        "--passes",
        type=positive,
        default=None,
        help="agents-replay: passes over every policy, each on fresh servers (default 3; --quick 2): "
        "more passes steady the wall figure on a loaded machine",
    )
    bench.add_argument("--seed", type=int, default=HELD_OUT_SEED, help="held-out item seed")
    bench.add_argument(
        "--report",
        action="store_true",
        help="run nothing: write docs/results.md and the README's headline table from the runs stored "
        "in docs/results/ (run from the repository root)",
    )


def add_calibrate_parser(commands: Any) -> None:
    """Register ``calibrate`` on the ``kamera`` command's subparsers."""
    calibrate = add_command(
        commands,
        "calibrate",
        "fit a model's drift calibration once (what its drift budget is kept with)",
        "Fit how a model's approximated chunks drift from their exact KV, on scripted episodes, and "
        "file the calibration where windows find it: a drift budget on that model then holds "
        "its estimate with the model's own constants.",
    )
    calibrate.add_argument(
        "model", help="'demo' (the shipped model), a checkpoint folder or a GGUF file (a text model or a VLM)"
    )
    calibrate.add_argument("--seeds", type=int, nargs="+", default=list(FIT_SEEDS), help="fitting episodes")
    calibrate.add_argument("--ops", type=int, default=60, help="ops per episode")
    calibrate.add_argument(
        "--audit", type=float, default=0.1, help="share of a chunk's tokens one audit recomputes"
    )
    calibrate.add_argument(
        "--quantile", type=float, default=0.99, help="share of fitting chunks the scale bounds"
    )
    calibrate.add_argument(
        "--texts",
        nargs="+",
        type=Path,
        default=[],
        metavar="FILE",
        help="a text model's episodes read passages of these files (default: the shipped corpus's "
        "calibration half)",
    )
    calibrate.add_argument("--out", default=None, help="where to file it (default: $KAMERA_CALIBRATION_DIR)")
    calibrate.add_argument(
        "--steps",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write what the episodes measured (each op's chunks and answer) to this JSON file",
    )
    calibrate.add_argument(
        "--refit",
        type=Path,
        default=None,
        metavar="FILE",
        help="fit again from a --steps file instead of running episodes (the model is loaded only "
        "for its fingerprint)",
    )
    calibrate.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="load the checkpoint in this dtype (default: its own): the dtype an engine serves it in, "
        "since a calibration is filed by the fingerprint of the weights and dtype",
    )
