"""A slow shared store costs a lookup its deadline, never more: abandoned, counted, computed locally.

Through `benchmarks/slow_proxy.py` (an asyncio proxy on loopback adding 300 ms to every chunk it
forwards) in front of a real Valkey server, every call is slower than the deadlines set here,
yet each answers within its timeout: the per-call timeout alone would let a lookup take seconds.
Each lookup that outlives its deadline must be abandoned there and counted; after three in a
row the server is skipped for a while (lookups cost nothing), and asked again once it is quick.
A window over such a store answers as the model's own re-prefill.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from benchmarks.slow_proxy import SlowProxy
from kamera_agent.backends.base import DecodeConfig
from kamera_agent.config import WindowConfig
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import ChunkStore, EntryKey
from kamera_agent.store.deadlines import DeadlineBounds, Deadlines
from kamera_agent.store.remote import connection
from kamera_agent.window import KameraWindow
from tests.backends.test_transformers_backend import images
from tests.window.backends import backend_named
from tests.window.helpers import reprefill

FP = "d" * 64
SLOW = "timeout=5&max_timeout=5&part_bytes=4096"
"""Per-call timeouts far above the proxy's delay (so only a deadline cuts a call), and small
parts (a large entry is many values, each many slow chunks)."""


def test_a_deadline_is_what_recomputing_the_entry_costs_within_its_floor_and_ceiling() -> None:
    deadlines = Deadlines(DeadlineBounds(factor=2.0, floor=0.05, ceiling=1.0))
    assert deadlines.for_tokens(100) == 1.0  # nothing measured yet: the ceiling
    deadlines.observe(1000, 0.5)  # 0.5 ms a token
    assert deadlines.for_tokens(100) == pytest.approx(0.1)  # 2 × 100 × 0.5 ms
    assert deadlines.for_tokens(10) == 0.05 and deadlines.for_tokens(10_000) == 1.0
    assert deadlines.for_tokens(None) == 1.0 and deadlines.header == 0.05
    deadlines.observe(1000, 1.5)  # slower now: the estimate moves toward it
    assert 0.5e-3 < (deadlines.seconds_per_token or 0) < 1.5e-3
    deadlines.observe(0, 1.0)  # no tokens: nothing to learn
    with pytest.raises(ValueError, match="floor"):
        DeadlineBounds(floor=2.0, ceiling=1.0)


@pytest.fixture
def proxy(store_url: str) -> Iterator[SlowProxy]:
    host, port = store_url.split("//")[1].split("/")[0].split(":")
    with SlowProxy((host, int(port)), delay=0.3) as slow:
        yield slow


def _kv(key: str, tokens: int) -> ChunkKV:
    g = torch.Generator().manual_seed(len(key))
    shape = (2, 2, tokens, 16)
    return ChunkKV(torch.randn(shape, generator=g), torch.randn(shape, generator=g), None, key, FP)


def _timed(lookup: object) -> float:
    began = time.monotonic()
    assert callable(lookup)
    lookup()
    return time.monotonic() - began


def test_every_lookup_that_outlives_its_deadline_is_abandoned_and_counted(
    store_url: str, proxy: SlowProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "SLOW_PAUSE", (0.3, 1.0))  # skipped for 0.3 s (2 s by default)
    with ChunkStore(fingerprint=FP, memory_limit=1 << 26, remote=f"{store_url}?{SLOW}") as writer:
        small, large = _kv("small", 4), _kv("large", 2048)  # inline, and 128 parts of 4 KiB
        writer.put_canonical(small)
        writer.put_canonical(large)
        writer.flush()
        assert writer.stats().remote_writes == 2
    url = f"redis://127.0.0.1:{proxy.port}/0?{SLOW}"
    bounds = DeadlineBounds(factor=1.0, floor=0.2, ceiling=0.4)
    reader = ChunkStore(fingerprint=FP, memory_limit=1 << 26, remote=url, deadlines=bounds)
    try:
        # each a round trip of at least 0.6 s through the proxy; the large one ~40 s in all
        lookups = [
            lambda: reader.get_canonical("small"),
            lambda: reader.get_canonical("large"),
            lambda: reader.has_canonical("absent"),
        ]
        seconds = [_timed(lookup) for lookup in lookups]
        stats = reader.stats()
        assert stats.remote_deadline_misses == 3 and stats.remote_hits == 0
        assert stats.remote_misses == 2 and stats.remote_errors == 2 and stats.unavailable == 3
        assert all(s < bounds.ceiling + 1.0 for s in seconds), seconds  # abandoned, not waited out
        assert stats.remote_state == "slow" and stats.remote_outages == 0
        # three in a row: the server is skipped for now, a lookup costs nothing and no deadline
        assert reader.get_canonical("small") is None
        assert reader.stats().remote_deadline_misses == 3
        proxy.delay = 0.0  # quick again: asked again after the pause, and served
        time.sleep(0.4)
        got = reader.get_canonical("small")
        assert got is not None and torch.equal(got.keys, small.keys)
        assert reader.stats().remote_state == "up"
    finally:
        reader.close()


def test_a_hit_within_its_deadline_is_taken_however_slow_the_link(store_url: str, proxy: SlowProxy) -> None:
    """The deadline scales with what the entry saves: a generous one lets a slow hit through."""
    with ChunkStore(fingerprint=FP, memory_limit=1 << 26, remote=f"{store_url}?{SLOW}") as writer:
        small = _kv("small", 4)
        writer.put_canonical(small)
        writer.flush()
    url = f"redis://127.0.0.1:{proxy.port}/0?{SLOW}"
    bounds = DeadlineBounds(factor=1.0, floor=5.0, ceiling=10.0)
    with ChunkStore(fingerprint=FP, memory_limit=1 << 26, remote=url, deadlines=bounds) as reader:
        got = reader.get_canonical("small")  # two round trips of ~0.6 s each
        assert got is not None and torch.equal(got.values, small.values)
        assert reader.stats().remote_deadline_misses == 0


def test_a_window_over_a_slow_store_answers_as_the_models_own_forward(proxy: SlowProxy) -> None:
    """Exact settings, a store whose every call outlives its deadline: each op computes what it
    would have fetched, writes are abandoned (the entries stay local), answers are the model's."""
    backend = backend_named("qwen2_vl")
    config = WindowConfig.exact(
        store_url=f"redis://127.0.0.1:{proxy.port}/0?{SLOW}",
        store_deadline_floor=0.1,
        store_deadline_ceiling=0.2,
        evicted_pixels="retain",
    )
    window = KameraWindow(backend, config=config)  # type: ignore[arg-type]
    pics = images(2, seed=3)
    a = window.push(pics[0], label="a")
    window.push("a note between the frames", label="b")
    window.push(pics[1], label="c")
    window.evict(a)
    window.recall(a, at=0)
    question = "What is it?"
    truth = reprefill(window, question).logits
    got = window.ask(question, decode=DecodeConfig(max_new_tokens=1)).first_logits
    assert float((got - truth).abs().max()) < 1e-4
    window.store.flush()
    stats = window.store.stats()
    assert stats.remote_deadline_misses > 0 and stats.remote_hits == 0
    assert stats.remote_writes == 0 and stats.remote_writes_failed > 0  # abandoned, or skipped
    assert window.store.contains(EntryKey.canonical(window.chunk(a).key))  # kept locally
    window.store.close()
