"""``kamera bench --suite agents-replay``: load both models, replay, print and write the table."""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kamera_agent.bench.agents.text_contents import TEXT_LENGTHS, TextContents, TextLengths
from kamera_agent.bench.published_agents import REPLAY_COLUMNS, markdown_table, replay_rows
from kamera_agent.bench.stopping import interruptible
from kamera_agent.replay.policies import POLICIES
from kamera_agent.replay.run import ReplayRun, ScreensFor, run_replay
from kamera_agent.replay.screens import TreeScreens

__all__ = ["replay_models", "replay_results", "run_replay_command"]

STEPS, QUICK_STEPS = 24, 4
PASSES, QUICK_PASSES = 3, 2
"""Passes over every policy (each on fresh servers, the side order flipped): the wall figure is
the median of every pass's per-step ratios, so one burst of load on the machine moves it little."""


def run_replay_command(args: argparse.Namespace, console: Console) -> int:
    """Run the replay (``args``: ``bench``'s: ``--quick``, ``--model``, ``--out``, ``--seed``,
    ``--passes``).

    A text model given by ``--model`` is replayed alone, its screens accessibility trees
    (`TreeScreens`); otherwise the demo model (or the VLM given) beside the realistic shape.
    """
    from kamera_agent.bench.progress import make_progress

    missing = [name for name in ("openai", "fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        console.print(
            f"[red]agents-replay drives kamera serve with the openai client: {', '.join(missing)} missing; "
            "pip install 'kamera-agent[serve,bench]'[/red]"
        )
        return 2
    began = time.perf_counter()
    backends, screens = replay_models(args)
    run = ReplayRun(
        steps=QUICK_STEPS if args.quick else STEPS,
        quick=args.quick,
        threads=torch.get_num_threads(),
        models=tuple(backends),
        policies=tuple(POLICIES),
        passes=_passes(args),
    )
    console.print(
        f"[bold]kamera bench[/bold] · agents-replay · {run.steps} steps × {len(run.policies)} policies × "
        f"{len(run.models)} model(s) × {run.passes} pass(es) · {run.threads} thread(s)"
    )
    interrupted = False
    with make_progress(console) as progress:
        try:
            with interruptible():
                run_replay(run, backends, progress, args.seed, screens)
        except KeyboardInterrupt:
            interrupted = True
    rows = replay_rows(run.to_json())
    console.print(_table(run, rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = replay_results(run, args, interrupted, time.perf_counter() - began)
    (out / "agents-replay.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / "agents-replay.md").write_text("\n".join(markdown_table(REPLAY_COLUMNS, rows)) + "\n")
    console.print(f"wrote {out / 'agents-replay.json'}, {out / 'agents-replay.md'}")
    return 130 if interrupted else 0


def replay_models(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, ScreensFor]]:
    """The backends replayed, by model name, and a text model's screens."""
    from kamera_agent.backends.transformers import TransformersBackend
    from kamera_agent.bench.agents.run import QUICK_SHAPE, realistic_backend
    from kamera_agent.demo.model import load_demo_model
    from kamera_agent.models.random_qwen2 import QWEN2_1_5B_SLICE

    if args.model is not None:
        from kamera_agent.loading import load_backend
        from kamera_agent.serve.command import read_chat_template

        backend = load_backend(args.model, chat_template=read_chat_template(args.chat_template))
        if backend.encoder.image_processor is None:  # a text model: accessibility-tree screens
            name = Path(args.model).name  # at agents' lengths, quick or not (quick: fewer steps)
            return {name: backend}, {name: partial(_tree_screens, backend, TEXT_LENGTHS)}
    demo, tokenizer, image_processor = load_demo_model(args.model)
    backends = {
        "demo": TransformersBackend(demo, tokenizer=tokenizer, image_processor=image_processor),
        "realistic": realistic_backend(QUICK_SHAPE if args.quick else QWEN2_1_5B_SLICE, args.seed),
    }
    return backends, {}


def _passes(args: argparse.Namespace) -> int:
    if args.passes is not None:
        return int(args.passes)
    return QUICK_PASSES if args.quick else PASSES


def _tree_screens(backend: Any, lengths: TextLengths, seed: int) -> TreeScreens:
    return TreeScreens(TextContents(backend.encoder, lengths, seed))


def _table(run: ReplayRun, rows: Sequence[tuple[str, ...]]) -> Table:
    table = Table(
        title=f"Agents replay: kamera (defaults) vs the same server as a prefix cache, {run.seconds:.0f} s"
    )
    for column in REPLAY_COLUMNS:
        table.add_column(column, justify="left" if column in ("model", "policy") else "right")
    for row in rows:
        table.add_row(*row)
    return table


def replay_results(
    run: ReplayRun, args: argparse.Namespace, interrupted: bool, seconds: float
) -> dict[str, Any]:
    """The replay as a ``kamera bench`` results.json holds a suite (the command's arguments, the
    machine, the date), so `kamera_agent.bench.published` renders it beside the other suites."""
    from kamera_agent.bench.common import machine_info

    model = None if args.model is None else str(args.model)
    from kamera_agent.serve.command import is_inline_template

    given = args.chat_template
    template = None if given is None else "(inline)" if is_inline_template(given) else Path(given).name
    return {
        "schema": 1,
        "partial": interrupted,
        "interrupted_in": "agents-replay" if interrupted else None,
        "seconds": seconds,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "seeds": {"replay": args.seed},
        "args": {
            "suite": "agents-replay",
            "model": model,
            "quick": bool(args.quick),
            "seed": args.seed,
            "chat_template": template,
            "passes": args.passes,
        },
        "suites": {"agents-replay": run.to_json()},
        "targets": [],
    }
