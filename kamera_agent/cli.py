"""The ``kamera`` command: ``demo`` (the README's main job), ``check`` a checkpoint, ``bench`` it,
``calibrate`` its drift estimate, ``store`` (a shared store's contents), ``serve`` (an
OpenAI-compatible chat server)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from kamera_agent.bench.calibrate import add_calibrate_parser, run_calibrate_command
from kamera_agent.bench.runner import add_bench_parser, run_bench_command
from kamera_agent.serve.command import add_serve_parser
from kamera_agent.settings import configure_threads
from kamera_agent.store.remote.command import add_store_parser, run_store_command

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kamera`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="kamera", description="kamera-agent: position-free multimodal KV reuse"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: $KAMERA_NUM_THREADS or 1)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="an agent episode on the shipped demo model, with costs")
    demo.add_argument(
        "--model", default=None, help="a kamera-tiny-vl checkpoint directory (default: shipped)"
    )
    demo.add_argument("--seed", type=int, default=8, help="which held-out demo items the episode uses")
    demo.add_argument(
        "--operator", action="store_true", help="show the bare operator on a random Qwen2 instead"
    )
    check = commands.add_parser("check", help="exactness checks on a local checkpoint, with a verdict table")
    check.add_argument("model", help="a local checkpoint directory (model + tokenizer + image processor)")
    check.add_argument(
        "--device", default=None, help="where to run the checks (default: where the model loads)"
    )
    check.add_argument("--debug", action="store_true", help="show the traceback when the model is refused")
    add_bench_parser(commands)
    add_calibrate_parser(commands)
    add_store_parser(commands)
    add_serve_parser(commands)
    for sub in commands.choices.values():  # `kamera bench --threads 1` works as `kamera --threads 1 bench`
        sub.add_argument(
            "--threads", type=int, default=argparse.SUPPRESS, help="torch threads (as before the command)"
        )
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "160")))
    if args.command == "bench":
        if args.suite == "agents-replay":  # drives kamera serve: above the bench suites' layer
            from kamera_agent.replay.command import run_replay_command

            return run_replay_command(args, console)
        return run_bench_command(args, console)
    if args.command == "calibrate":
        return run_calibrate_command(args, console)
    if args.command == "store":
        return run_store_command(args, console)
    if args.command == "serve":
        from kamera_agent.serve.command import run_serve_command

        return run_serve_command(args, console)
    if args.command == "demo":
        if args.operator:
            from kamera_agent.demo.operator_demo import run_operator_demo

            run_operator_demo(console)
            return 0
        from kamera_agent.demo.episode import run_demo_episode
        from kamera_agent.demo.model import DEMO_MODEL_DIR

        if args.model is None and not (DEMO_MODEL_DIR / "config.json").is_file():
            from kamera_agent.demo.operator_demo import run_operator_demo

            console.print(
                f"[yellow]kamera-tiny-vl's weights are missing from {DEMO_MODEL_DIR} (reinstall, or retrain "
                "with `python training/train_demo_model.py`): showing the operator demo instead[/yellow]"
            )
            run_operator_demo(console)
            return 0
        run_demo_episode(console, args.model, seed=args.seed)
        return 0
    from kamera_agent.check import run_check
    from kamera_agent.errors import KameraError

    try:
        return 0 if run_check(args.model, console, device=args.device).passed else 1
    except KameraError as exc:
        if args.debug:
            raise
        console.print(f"[red]kamera check: refused — {escape(str(exc))}[/red] (--debug shows the traceback)")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
