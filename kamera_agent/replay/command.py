"""``kamera bench --suite agents-replay``: load both models, replay, print and write the table."""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kamera_agent.replay.policies import POLICIES
from kamera_agent.replay.run import ReplayRun, run_replay, summary_rows

__all__ = ["COLUMNS", "run_replay_command"]

COLUMNS = (
    "model",
    "policy",
    "steps",
    "prefix tokens",
    "kamera tokens",
    "tokens prefix/kamera",
    "prefix s",
    "kamera s",
    "wall prefix/kamera",
    "top-1 = prefix",
)
STEPS, QUICK_STEPS = 24, 4


def run_replay_command(args: argparse.Namespace, console: Console) -> int:
    """Run the replay (``args``: ``bench``'s: ``--quick``, ``--model``, ``--out``, ``--seed``)."""
    from kamera_agent.backends.transformers import TransformersBackend
    from kamera_agent.bench.agents.run import QUICK_SHAPE, realistic_backend
    from kamera_agent.bench.common import make_progress
    from kamera_agent.demo.model import load_demo_model
    from kamera_agent.models.random_qwen2 import QWEN2_1_5B_SLICE

    missing = [name for name in ("openai", "fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        console.print(
            f"[red]agents-replay drives kamera serve with the openai client: {', '.join(missing)} missing; "
            "pip install 'kamera-agent[serve,bench]'[/red]"
        )
        return 2
    began = time.perf_counter()
    demo, tokenizer, image_processor = load_demo_model(args.model)
    backends = {
        "demo": TransformersBackend(demo, tokenizer=tokenizer, image_processor=image_processor),
        "realistic": realistic_backend(QUICK_SHAPE if args.quick else QWEN2_1_5B_SLICE, args.seed),
    }
    run = ReplayRun(
        steps=QUICK_STEPS if args.quick else STEPS,
        quick=args.quick,
        threads=torch.get_num_threads(),
        models=tuple(backends),
        policies=tuple(POLICIES),
    )
    console.print(
        f"[bold]kamera bench[/bold] · agents-replay · {run.steps} steps × {len(run.policies)} policies × "
        f"{len(run.models)} models · {run.threads} thread(s)"
    )
    interrupted = False
    with make_progress(console) as progress:
        try:
            run_replay(run, backends, progress, args.seed)
        except KeyboardInterrupt:
            interrupted = True
    table = Table(
        title=f"Agents replay: kamera (defaults) vs the same server as a prefix cache, {run.seconds:.0f} s"
    )
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("model", "policy") else "right")
    rows = summary_rows(run)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"partial": interrupted, "wall_seconds": time.perf_counter() - began, **run.to_json()}
    (out / "agents-replay.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * 2 + "---:|" * (len(COLUMNS) - 2)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    (out / "agents-replay.md").write_text("\n".join(lines) + "\n")
    console.print(f"wrote {out / 'agents-replay.json'}, {out / 'agents-replay.md'}")
    return 130 if interrupted else 0
