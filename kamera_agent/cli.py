"""The ``kamera`` command: ``kamera demo`` for now; ``bench`` and ``check`` follow."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rich.console import Console

from kamera_agent.settings import configure_threads

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kamera`` console script."""
    parser = argparse.ArgumentParser(
        prog="kamera", description="kamera-agent: position-free multimodal KV reuse"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: $KAMERA_NUM_THREADS or 1)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="show relocation and patching on a locally built model")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    console = Console()
    if args.command == "demo":
        from kamera_agent.demo.operator_demo import run_operator_demo

        run_operator_demo(console, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
