"""``kamera bench``: run the suites in one process, then write results.json, report.md and plots.

Why one process and one run: every arm and both sides of every comparison are measured on
the same items, the same model and the same machine state, so their ratios can be trusted on
a noisy machine. Ctrl-C stops the run but keeps what finished: results.json is written and
marked partial, and the exit status is 130.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from kamera_agent.bench.common import BenchOptions
from kamera_agent.bench.cost import CostRun, CostShape, run_cost
from kamera_agent.bench.fidelity import FidelityRun, run_fidelity
from kamera_agent.bench.frontier import ROWS, FrontierRun
from kamera_agent.bench.plots import plots_available, write_plots
from kamera_agent.bench.progress import make_progress
from kamera_agent.bench.report import grids, print_report, write_markdown
from kamera_agent.bench.results import BenchResults
from kamera_agent.bench.stopping import interruptible
from kamera_agent.bench.window_suite import WindowRun, run_window
from kamera_agent.parsers.bench import add_bench_parser  # declared without torch: `kamera --help`

__all__ = ["BenchOutcome", "add_bench_parser", "run_bench", "run_bench_command"]

INTERRUPTED = 130
"""Exit status of a run stopped with Ctrl-C (128 + SIGINT), as shells report it."""
USAGE_ERROR = 2
"""Exit status when the run cannot start (no demo model where the suites need one)."""


@dataclass(frozen=True)
class BenchOutcome:
    """What a run left behind: its exit status, results and the files written."""

    exit_code: int
    results: BenchResults
    files: list[Path]


def run_bench_command(args: argparse.Namespace, console: Console) -> int:
    """Run ``kamera bench`` from parsed arguments; returns the exit status."""
    if args.report:
        from kamera_agent.bench.published import RESULTS, publish

        if not RESULTS.is_dir():
            console.print(f"[red]--report: no {RESULTS}/ here; run it from the repository root")
            return USAGE_ERROR
        written = publish(Path.cwd())
        console.print(f"wrote {', '.join(str(path) for path in written)}")
        return 0
    options = BenchOptions(
        suite=args.suite,
        model=args.model,
        out=Path(args.out),
        quick=args.quick,
        items=args.items,
        ops=args.ops,
        rows=tuple(args.rows),
        agents=tuple(args.agents),
        seed=args.seed,
    )
    return run_bench(options, console).exit_code


def run_bench(options: BenchOptions, console: Console | None = None) -> BenchOutcome:
    """Run the chosen suites, print the tables and write the outputs, even when interrupted."""
    console = console or Console()
    results, began = BenchResults(options), time.perf_counter()
    console.rule(
        f"[bold]kamera bench[/bold] · {', '.join(options.suites)}{' · quick' if options.quick else ''} · "
        f"{torch.get_num_threads()} thread(s)"
    )
    exit_code, context = 0, _Context(options, results)
    missing = _missing_model(context)
    if missing:
        console.print(f"[red]{missing}")
        return BenchOutcome(USAGE_ERROR, results, [])
    try:
        with interruptible(), make_progress(console) as progress:
            for name in options.suites:
                results.interrupted = name
                SUITES[name](context, progress)
        results.interrupted = None
    except KeyboardInterrupt:
        results.partial, exit_code = True, INTERRUPTED
        console.print(f"[yellow]interrupted in the {results.interrupted} suite: writing what finished")
    results.seconds = time.perf_counter() - began
    files = _write_outputs(results, console)
    return BenchOutcome(exit_code, results, files)


@dataclass
class _Context:
    """What the suites share: the options, the live results, the demo model (loaded once)."""

    options: BenchOptions
    results: BenchResults
    _model: tuple[Any, Any, Any] | None = field(default=None, repr=False)

    @property
    def model_name(self) -> str:
        from kamera_agent.demo.model import DEMO_MODEL_DIR

        return str(self.options.model or DEMO_MODEL_DIR)

    def demo_model(self, progress: Progress) -> tuple[Any, Any, Any]:
        """``(model, tokenizer, image_processor)`` of ``--model`` (a folder or a GGUF file; the
        shipped demo model by default), loaded once."""
        if self._model is None:
            from transformers.utils import logging as hf_logging

            task = progress.add_task("loading the model", total=1)
            shown = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # ours shows the load; theirs would break the layout
            try:
                self._model = _load(self.options.model)
            finally:
                if shown:
                    hf_logging.enable_progress_bar()
            progress.advance(task)
        return self._model


def _load(path: Path | str | None) -> tuple[Any, Any, Any]:
    if path is None:
        from kamera_agent.demo.model import load_demo_model

        return load_demo_model()  # type: ignore[no-any-return]
    from kamera_agent.loading import load_backend

    backend = load_backend(path)
    return backend.model, backend.tokenizer, backend.encoder.image_processor


_IMAGE_SUITES = ("fidelity",)
"""Suites built on the demo task's images: they need a vision model (the demo model's kind).
The window and agents suites give a text model real text instead."""


def _missing_model(context: _Context) -> str:
    """Why the chosen suites cannot run (before any of them starts), or ``""``."""
    from kamera_agent.checkpoints import resolve_checkpoint
    from kamera_agent.errors import CheckpointError

    suites = set(context.options.suites)
    if not {"fidelity", "window", "agents"} & suites:
        return ""
    if context.options.model is None:
        from kamera_agent.demo.model import DEMO_MODEL_DIR

        if (DEMO_MODEL_DIR / "config.json").is_file():
            return ""
        return (
            f"no kamera-tiny-vl weights in {DEMO_MODEL_DIR}: train them with "
            "`python training/train_demo_model.py`, pass --model PATH, or run --suite cost alone"
        )
    try:
        folder = resolve_checkpoint(context.options.model).folder
    except CheckpointError as exc:
        return f"--model: {exc}"
    needs_images = sorted(suites & set(_IMAGE_SUITES))
    if needs_images and not _reads_images(folder):
        return (
            f"--suite {' and '.join(needs_images)}: the demo task's images, and "
            f"{context.options.model} reads text only; run --suite window or agents (real text for "
            "frames and pages) or --suite cost"
        )
    return ""


def _reads_images(folder: Path) -> bool:
    import json

    config = json.loads((folder / "config.json").read_text())
    return isinstance(config, dict) and "vision_config" in config


def _fidelity(context: _Context, progress: Progress) -> None:
    from kamera_agent.backends.transformers import TransformersBackend
    from kamera_agent.demo.task import make_items

    options = context.options
    model, tokenizer, image_processor = context.demo_model(progress)
    run = FidelityRun(model=context.model_name, seed=options.seed, items_requested=options.item_count)
    context.results.fidelity = run
    backend = TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)
    items = make_items(options.item_count, options.seed)
    control = make_items(max(1, options.item_count // CONTROL_SHARE), options.seed + 1, "colour", sparse=True)
    run_fidelity(backend, items, run, progress, control)


CONTROL_SHARE = 4
"""The sparse-binding control runs on one item for every ``CONTROL_SHARE`` main items."""


def _cost(context: _Context, progress: Progress) -> None:
    shape = CostShape.quick() if context.options.quick else CostShape()
    context.results.cost = run = CostRun(shape, torch.get_num_threads(), quick=context.options.quick)
    run_cost(run, progress, context.options.seeds["cost_model"])


def _window(context: _Context, progress: Progress) -> None:
    options = context.options
    model, tokenizer, image_processor = context.demo_model(progress)
    frontier = FrontierRun(seed=options.seeds["episode"], ops_requested=options.op_count)
    if image_processor is None:
        frontier.content = "passages of real text (the benchmark half of kamera's corpus)"
    if options.rows:
        frontier.rows = tuple(name for name in ROWS if name in options.rows)
    context.results.window = frontier
    began = time.perf_counter()
    try:
        for name in frontier.rows:
            row = ROWS[name]
            run = WindowRun(
                row=name,
                seed=frontier.seed,
                ops_requested=frontier.ops_requested,
                capacity=frontier.capacity,
                changed=row.changed,
                followers=row.followers,
            )
            frontier.runs.append(run)
            run_window(model, tokenizer, image_processor, run, row.config(frontier.capacity), progress)
    finally:
        frontier.seconds = time.perf_counter() - began


def _agents(context: _Context, progress: Progress) -> None:
    """The agents on the demo model and the realistic shape; on a text model given by
    ``--model``, on that model alone, over real text (`run_text_suite`)."""
    from kamera_agent.bench.agents.run import new_run, run_suite, run_text_suite
    from kamera_agent.loading import load_backend

    options = context.options
    model, tokenizer, image_processor = parts = context.demo_model(progress)
    if image_processor is not None:
        context.results.agents = run = new_run(options.quick, options.agents, context.model_name)
        run_suite(run, parts, options.seeds["agents"], progress)
        return
    name = Path(context.model_name).name
    context.results.agents = run = new_run(options.quick, options.agents, name, text=True)
    run_text_suite(run, load_backend(model, tokenizer=tokenizer), options.seeds["agents"], progress)


SUITES: Mapping[str, Callable[[_Context, Progress], None]] = MappingProxyType(
    {"fidelity": _fidelity, "cost": _cost, "window": _window, "agents": _agents}
)


def _write_outputs(results: BenchResults, console: Console) -> list[Path]:
    out = results.options.out
    out.mkdir(parents=True, exist_ok=True)
    tables = grids(results)
    print_report(console, tables)
    files = [out / "results.json", out / "report.md"]
    files[0].write_text(json.dumps(_strict(results.to_json()), indent=2, allow_nan=False) + "\n")
    write_markdown(files[1], results, tables)
    if plots_available():
        with make_progress(console) as progress:
            task = progress.add_task("writing plots", total=1)
            files += write_plots(results, out)
            progress.advance(task)
    else:
        console.print("[dim]plots skipped: matplotlib is not installed (pip install 'kamera-agent\\[bench]')")
    console.print(f"wrote {', '.join(str(path) for path in files)}")
    return files


def _strict(value: Any) -> Any:
    """``value`` with every non-finite float as ``None`` and tuples as lists: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _strict(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(item) for item in value]
    return value
