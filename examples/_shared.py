"""What the examples share: a window on the demo model (or ``--model PATH``) and a cost table.

Each row of the table is one window operation: the language-model forwards it ran (``fwd``),
the vision encodes, the tokens it prefilled and the chunk tokens it reused from the store, and,
for comparison, two token counts (counted, not run): what a **prefix cache** would prefill for
the same op (a radix cache at its best, shared by every window of the run and never evicting,
synced at every op as `kamera bench` runs one: everything from the first chunk whose leading
sequence it has not seen, plus the query), and what a **full re-prefill** of the window (anchor,
every chunk, the query) would prefill, which no serving engine pays at every op.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kamera_agent import ChunkRef, KameraWindow, OpCost, WindowConfig, configure_threads
from kamera_agent.demo.model import load_demo_model

__all__ = ["CostLog", "CostRow", "PrefixCacheCount", "example_parser", "open_window", "reprefill_tokens"]


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


@dataclass
class PrefixCacheCount:
    """The tokens a radix prefix cache would prefill: every leading chunk sequence it has seen is
    cached (keyed by the chunks' content keys, the anchor first), and a request prefills from
    the first chunk whose leading sequence is new, then its query."""

    seen: set[tuple[str, ...]] = field(default_factory=set)

    def prefill(self, window: KameraWindow, refs: list[ChunkRef], query: str | None = None) -> int:
        path: tuple[str, ...] = ()
        tokens = 0
        for chunk in [window.encoder.anchor(), *(window.chunk(ref) for ref in refs)]:
            path = (*path, chunk.key)
            if path not in self.seen:
                self.seen.add(path)
                tokens += chunk.num_tokens
        return tokens + (0 if query is None else int(window.encoder.query_ids(query).shape[0]))


@dataclass(frozen=True)
class CostRow:
    """One operation's cost beside what a prefix cache and a full re-prefill would have prefilled."""

    step: int
    op: str
    what: str
    cost: OpCost
    reprefill: int
    prefix: int


@dataclass
class CostLog:
    """The cost rows of a run, printed as one table."""

    rows: list[CostRow] = field(default_factory=list)
    prefix_cache: PrefixCacheCount = field(default_factory=PrefixCacheCount)

    def record(
        self,
        step: int,
        op: str,
        what: str,
        window: KameraWindow,
        query: str | None = None,
        without: ChunkRef | None = None,
    ) -> CostRow:
        """Log ``window``'s last operation (``query``: the question an ``ask`` or a probe answered;
        ``without``: the chunk a ``probe_without`` left out, which a prefix cache answers twice)."""
        refs = list(window.refs)
        prefix = self.prefix_cache.prefill(window, refs, query)
        if without is not None:
            prefix += self.prefix_cache.prefill(window, [ref for ref in refs if ref != without], query)
        row = CostRow(step, op, what, window.stats.last, reprefill_tokens(window, query), prefix)
        self.rows.append(row)
        return row

    def print(self, title: str) -> None:
        table = Table(title=title)
        table.add_column("step", justify="right")
        table.add_column("op")
        table.add_column("chunk", no_wrap=True)
        for name in ("fwd", "vision", "prefill", "reused", "prefix cache", "full re-prefill"):
            table.add_column(name, justify="right")
        for row in self.rows:
            cost = row.cost
            numbers = (cost.forwards, cost.vision_encodes, cost.tokens_prefilled, cost.tokens_reused)
            table.add_row(
                str(row.step),
                row.op,
                escape(row.what),
                *map(str, numbers),
                str(row.prefix),
                str(row.reprefill),
            )
        spent = sum(row.cost.tokens_prefilled for row in self.rows)
        table.caption = (
            f"tokens prefilled: kamera {spent}, a prefix cache {self.prefix_total}, "
            f"a full re-prefill at every op {self.reprefill_total}"
        )
        Console(width=max(Console().width, 100)).print(table)  # a pipe gets 80 columns: too few

    @property
    def reprefill_total(self) -> int:
        return sum(row.reprefill for row in self.rows)

    @property
    def prefix_total(self) -> int:
        return sum(row.prefix for row in self.rows)
