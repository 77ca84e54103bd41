"""What the examples share: a window on the demo model (or ``--model PATH``) and a cost table.

Each row of the table is one window operation: the language-model forwards it ran (``fwd``),
the vision encodes, the tokens it prefilled and the chunk tokens it reused from the store, and,
for comparison, the tokens a full re-prefill of the window (anchor, every chunk, the query)
would have prefilled at that point.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kamera_agent import KameraWindow, OpCost, WindowConfig, configure_threads
from kamera_agent.demo.model import load_demo_model

__all__ = ["CostLog", "CostRow", "example_parser", "open_window", "reprefill_tokens"]


def example_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser with the options every example takes: ``--model``, ``--max-new-tokens``, ``--threads``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a Hugging Face VLM checkpoint (default: kamera-tiny-vl)")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="answer length (default: 4)")
    parser.add_argument("--threads", type=int, help="torch threads (default: $KAMERA_NUM_THREADS, else 1)")
    return parser


def open_window(args: argparse.Namespace, config: WindowConfig) -> KameraWindow:
    """A window on the checkpoint ``args.model``, or on the shipped demo model when none is given.

    Pins torch's threads first: on a small busy machine one thread per core makes a tiny
    model's ops many times slower than one thread.
    """
    configure_threads(args.threads)
    if args.model is not None:
        return KameraWindow(args.model, config=config)
    demo, tokenizer, image_processor = load_demo_model()
    return KameraWindow(demo, tokenizer=tokenizer, image_processor=image_processor, config=config)


def reprefill_tokens(window: KameraWindow, query: str | None = None) -> int:
    """Tokens a full re-prefill of the window (anchor, its chunks, the query) would prefill."""
    encoder = window.encoder
    tokens = encoder.anchor().num_tokens + sum(window.chunk(ref).num_tokens for ref in window.refs)
    return tokens + (0 if query is None else int(encoder.query_ids(query).shape[0]))


@dataclass(frozen=True)
class CostRow:
    """One operation's cost beside what a re-prefill of the window would have prefilled."""

    step: int
    op: str
    what: str
    cost: OpCost
    reprefill: int


@dataclass
class CostLog:
    """The cost rows of a run, printed as one table."""

    rows: list[CostRow] = field(default_factory=list)

    def record(
        self, step: int, op: str, what: str, window: KameraWindow, query: str | None = None
    ) -> CostRow:
        """Log ``window``'s last operation (``query``: the question an ``ask`` answered)."""
        row = CostRow(step, op, what, window.stats.last, reprefill_tokens(window, query))
        self.rows.append(row)
        return row

    def print(self, title: str) -> None:
        table = Table(title=title)
        table.add_column("step", justify="right")
        table.add_column("op")
        table.add_column("chunk", no_wrap=True)
        for name in ("fwd", "vision", "prefill", "reused", "re-prefill"):
            table.add_column(name, justify="right")
        for row in self.rows:
            cost = row.cost
            numbers = (cost.forwards, cost.vision_encodes, cost.tokens_prefilled, cost.tokens_reused)
            table.add_row(str(row.step), row.op, escape(row.what), *map(str, numbers), str(row.reprefill))
        spent = sum(row.cost.tokens_prefilled for row in self.rows)
        table.caption = f"tokens prefilled: {spent}; re-prefilling at every op: {self.reprefill_total}"
        Console(width=max(Console().width, 100)).print(table)  # a pipe gets 80 columns: too few

    @property
    def reprefill_total(self) -> int:
        return sum(row.reprefill for row in self.rows)
