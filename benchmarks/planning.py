"""Planning benchmark: how long ``window.plan(op)`` takes as the window grows, side by side.

Planning must stay far below a forward (the goal: < 1 ms median for any op on a 64-chunk window)
and grow linearly: each chunk's state is chained from the one before it in O(1), never by
re-hashing its whole left context. Measured on the plain-torch backend (planning never runs
the model, so the engine does not matter), for windows of 8/16/32/64 text chunks with patches
formed, one chunk evicted so recalls can be planned, median over ``--repeats`` plans per op:

- push: a new chunk at the end (prepared beforehand: tokenizing is not planning);
- reorder: a random permutation of every chunk (each one decided anew);
- slide / evict: the oldest leaves / a middle chunk leaves;
- recall: the evicted chunk back at the front (every chunk after it cascades).

    python benchmarks/planning.py                    # 8 16 32 64 chunks, 200 repeats
    python benchmarks/planning.py --json plan.json
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from rich.table import Table

from kamera_agent.backends.tiny_torch import TinyConfig, TinyTorchBackend
from kamera_agent.bench.common import show_and_save
from kamera_agent.config import WindowConfig
from kamera_agent.settings import configure_threads
from kamera_agent.window import KameraWindow

OPS = ("push", "reorder", "slide", "evict", "recall")


def build(backend: TinyTorchBackend, chunks: int, rank: int | str) -> tuple[KameraWindow, dict[str, Any]]:
    """A window of ``chunks`` text chunks plus one evicted, and the arguments of each planned op."""
    window = KameraWindow(backend, config=WindowConfig(rank=rank, max_evicted=None))  # type: ignore[arg-type]
    refs = [window.push(f"chunk {i:02d} of the window.") for i in range(chunks + 1)]
    gone = refs[chunks // 2]
    window.evict(gone)
    order = window.refs
    random.Random(chunks).shuffle(order)
    args = {
        "push": (backend.encoder.text("a new chunk at the end."),),
        "reorder": (order,),
        "slide": (1,),
        "evict": (window.refs[len(window) // 2],),
        "recall": (gone, 0),
    }
    return window, args


def planning(window: KameraWindow, op: str, args: tuple[Any, ...]) -> Callable[[], object]:
    """The dry run that is timed: ``window.plan(op, *args)``."""
    return lambda: window.plan(op, *args)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rank", default="32", help="patch rank (an int or 'full')")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    configure_threads(1)
    rank: int | str = args.rank if args.rank == "full" else int(args.rank)
    backend = TinyTorchBackend(TinyConfig(max_positions=1 << 16))
    rows: dict[int, dict[str, float]] = {}
    for size in args.chunks:
        window, op_args = build(backend, size, rank)
        rows[size] = {op: median_ms(planning(window, op, op_args[op]), args.repeats) for op in OPS}
    report = {
        "machine": platform.platform(),
        "python": platform.python_version(),
        "repeats": args.repeats,
        "rank": rank,
        "median_ms": {str(size): row for size, row in rows.items()},
    }
    table = Table(title=f"window.plan(op): median ms over {args.repeats} plans (1 thread)")
    table.add_column("chunks", justify="right")
    for op in OPS:
        table.add_column(op, justify="right")
    for size, row in rows.items():
        table.add_row(str(size), *(f"{row[op]:.3f}" for op in OPS))
    return show_and_save(table, report, args.json)


if __name__ == "__main__":
    main()
