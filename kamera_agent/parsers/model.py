"""``kamera demo``, ``kamera check`` and ``kamera store``: their arguments."""

from __future__ import annotations

from typing import Any

from kamera_agent.parsers import add_command

__all__ = ["STORE_URL_VARIABLE", "add_check_parser", "add_demo_parser", "add_store_parser"]

STORE_URL_VARIABLE = "KAMERA_STORE_URL"
"""Where ``kamera store`` reads the store's URL when ``--url`` is not given (as every window)."""


def add_demo_parser(commands: Any) -> None:
    """Register ``demo``."""
    demo = add_command(
        commands,
        "demo",
        "an agent episode on the shipped demo model, with costs",
        "An agent's window over kamera-tiny-vl, the shipped demo model, offline: legend frames and "
        "pages pushed, reordered, probed, evicted, recalled and slid, each op's answer and cost beside "
        "a prefix cache's on the same model; then blind reuse against patches on more items. "
        "--operator shows the bare operator (relocation, patch rank against KL) instead.",
    )
    demo.add_argument(
        "--model", default=None, help="a kamera-tiny-vl checkpoint directory (default: shipped)"
    )
    demo.add_argument("--seed", type=int, default=8, help="which held-out demo items the episode uses")
    demo.add_argument(
        "--operator", action="store_true", help="show the bare operator on a random Qwen2 instead"
    )


def add_check_parser(commands: Any) -> None:
    """Register ``check``."""
    check = add_command(
        commands,
        "check",
        "exactness checks on a local checkpoint, with a verdict table",
        "Run the exactness checks the test suite runs on tiny models on your own weights, against "
        "the model's own forward: relocation, a full-rank patch moved to another offset, and a "
        "window's greedy answer against model.generate. Exit status 0 when all pass.",
    )
    check.add_argument("model", help="a checkpoint folder or GGUF file (model, tokenizer, image processor)")
    check.add_argument(
        "--device", default=None, help="where to run the checks (default: where the model loads)"
    )


def add_store_parser(commands: Any) -> None:
    """Register ``store``."""
    store = add_command(
        commands,
        "store",
        "a shared store (Valkey/Redis, S3, any registered tier): what it holds, or empty it",
        "Count kamera's entries on a shared store by kind and model, or delete them: the URL's "
        "scheme names the tier (redis://, valkey://, s3://, any registered one): the store the "
        "workers share, named as they name it.",
    )
    store.add_argument(
        "action", choices=("stats", "clear"), help="stats: count kamera's entries; clear: delete them"
    )
    store.add_argument("--url", default=None, help=f"the store's URL (default: ${STORE_URL_VARIABLE})")
    store.add_argument("--model", default=None, help="only this model fingerprint's entries")
    store.add_argument("--yes", action="store_true", help="clear without asking")
