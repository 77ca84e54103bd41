"""The ``kamera`` command: ``demo`` (the README's main job), ``check`` a checkpoint, ``bench`` it,
``calibrate`` its drift estimate, ``store`` (a shared store's contents), ``serve`` (an
OpenAI-compatible chat server).

Why parsers apart from what they run: every command's parser (`kamera_agent.parsers`) imports
the standard library only, so ``kamera --help``, ``kamera serve --help`` and ``kamera --version``
answer at once; a command's own modules (torch, the model stack) are imported when it runs.
Every refusal at the command line is one line naming the problem and the fix, exit status 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from kamera_agent import __version__
from kamera_agent.errors import KameraError, SettingsError
from kamera_agent.parsers import DefaultsShown, positive
from kamera_agent.parsers.bench import add_bench_parser, add_calibrate_parser
from kamera_agent.parsers.model import add_check_parser, add_demo_parser, add_store_parser
from kamera_agent.parsers.serve import add_serve_parser

__all__ = ["build_parser", "main"]

USAGE_ERROR = 2
"""The exit status of a refusal (argparse's own for a bad argument)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``kamera`` parser: every command, each with its description and defaults shown."""
    parser = argparse.ArgumentParser(
        prog="kamera",
        description="kamera-agent: position-free multimodal KV reuse",
        formatter_class=DefaultsShown,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--threads", type=positive, default=None, help="torch threads (default: $KAMERA_NUM_THREADS or 1)"
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of a refusal")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        add_demo_parser,
        add_check_parser,
        add_bench_parser,
        add_calibrate_parser,
        add_store_parser,
        add_serve_parser,
    ):
        add(commands)
    for sub in commands.choices.values():  # `kamera bench --threads 1` works as `kamera --threads 1 bench`
        sub.add_argument("--threads", type=positive, default=argparse.SUPPRESS, help="torch threads")
        sub.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a refusal"
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kamera`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "160")))
    try:
        _threads(args.threads)
        return _run(args, console)
    except KameraError as exc:  # a model, file or setting the command cannot take
        if args.debug:
            raise
        console.print(
            f"[red]kamera {args.command}: refused — {escape(str(exc))}[/red] (--debug shows the traceback)",
            soft_wrap=True,  # one line however long: a log or a test reads it whole
        )
        return USAGE_ERROR


def _threads(count: int | None) -> None:
    """torch's thread count (``--threads``, else ``$KAMERA_NUM_THREADS``, else 1).

    Raises:
        SettingsError: ``$KAMERA_NUM_THREADS`` that is not a count.
    """
    from kamera_agent.settings import configure_threads

    try:
        configure_threads(count)
    except ValueError as exc:
        raise SettingsError(f"{exc}: set it to a whole number of at least 1, or pass --threads") from exc


def _run(args: argparse.Namespace, console: Console) -> int:
    """The chosen command, its modules imported now."""
    if args.command == "bench":
        if args.chat_template is not None and (args.suite != "agents-replay" or args.model is None):
            raise SettingsError(
                "--chat-template frames a text model's conversations under --suite agents-replay with "
                "--model; the other suites ask plain prompts and the demo model has its own: drop it"
            )
        if args.passes is not None and args.suite != "agents-replay":
            raise SettingsError("--passes counts agents-replay's passes; the other suites run once: drop it")
        if args.suite == "agents-replay":  # drives kamera serve: above the bench suites' layer
            from kamera_agent.replay.command import run_replay_command

            return run_replay_command(args, console)
        from kamera_agent.bench.runner import run_bench_command

        return run_bench_command(args, console)
    if args.command == "calibrate":
        from kamera_agent.bench.calibrate import run_calibrate_command

        return run_calibrate_command(args, console)
    if args.command == "store":
        from kamera_agent.store.command import run_store_command

        return run_store_command(args, console)
    if args.command == "serve":
        from kamera_agent.serve.command import run_serve_command

        return run_serve_command(args, console)
    if args.command == "demo":
        return _demo(args, console)
    from kamera_agent.check import run_check

    return 0 if run_check(args.model, console, device=args.device).passed else 1


def _demo(args: argparse.Namespace, console: Console) -> int:
    """``kamera demo``: the episode, or the operator demo (asked for, or the weights missing)."""
    from kamera_agent.demo.model import DEMO_MODEL_DIR

    missing = args.model is None and not (DEMO_MODEL_DIR / "config.json").is_file()
    if missing and not args.operator:
        console.print(
            f"[yellow]kamera-tiny-vl's weights are missing from {DEMO_MODEL_DIR} (reinstall, or retrain "
            "with `python training/train_demo_model.py`): showing the operator demo instead[/yellow]"
        )
    if args.operator or missing:
        from kamera_agent.demo.operator_demo import run_operator_demo

        run_operator_demo(console)
        return 0
    from kamera_agent.demo.episode import run_demo_episode

    run_demo_episode(console, args.model, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
