"""kamera's series on SGLang's ``/metrics``: the cache's counts and every store tier's, published
as requests are released (run in .venv-sglang; ``prometheus_client``'s classes are stood in for
by `Recorded`, the shape SGLang's multiprocess mode collects)."""

from __future__ import annotations

from typing import Any

import pytest

from kamera_agent.config import WindowConfig
from kamera_agent.engines.sglang.metrics import CacheExport
from kamera_agent.store import ChunkStore
from kamera_agent.testing import FakeTier
from tests.engines.sglang.test_radix import _backend, _prompt, _run, _setup, _text

pytestmark = pytest.mark.sglang


class Metric:
    """A ``prometheus_client`` metric's stand-in: each child's value by its label values."""

    def __init__(self, labelnames: list[str]) -> None:
        self.labelnames = labelnames
        self.values: dict[tuple[str, ...], float] = {}

    def labels(self, *values: object) -> Metric.Child:
        key = tuple(str(v) for v in values)
        self.values.setdefault(key, 0.0)
        return Metric.Child(self, key)

    class Child:
        def __init__(self, metric: Metric, key: tuple[str, ...]) -> None:
            self.metric, self.key = metric, key

        def inc(self, n: float = 1.0) -> None:
            self.metric.values[self.key] += n

        def set(self, value: float) -> None:
            self.metric.values[self.key] = value


class Recorded:
    """Metric classes by kind, as SGLang's process registry would hold them: every one made, by name."""

    def __init__(self) -> None:
        self.made: dict[str, Metric] = {}
        self.kinds = {"counter": self._make, "gauge": self._make}

    def _make(self, name: str, documentation: str, labelnames: list[str], **options: Any) -> Metric:
        self.made[name] = Metric(labelnames)
        return self.made[name]


def test_the_caches_counts_and_every_store_tier_reach_sglangs_metrics() -> None:
    recorded = Recorded()
    backend = _backend("qwen2")
    store = ChunkStore(fingerprint=backend.fingerprint, memory_budget=1 << 28, tiers=[FakeTier()])
    harness, model = _setup(backend, 1, WindowConfig.exact(), store=store)
    cache = harness.tree_cache
    cache.export = CacheExport(store, {"model_name": "tiny"}, recorded.kinds, every=0)
    assert recorded.made["sglang:kamera_loaded_tokens"].values == {("tiny",): 0.0}  # present from the start
    assert "sglang:kamera_dropped_captures" not in recorded.made  # the vLLM connector's own
    chunks = [_text(backend, "notes from the first morning of the trip"), _text(backend, "then rain")]
    _run(harness, model, _prompt(backend, [*chunks, _text(backend, "what fell?")]), "first")
    harness.drain()  # released: the cache publishes
    captured = recorded.made["sglang:kamera_captured_chunks"].values[("tiny",)]
    puts = recorded.made["sglang:kamera_store_tier_puts"].values[("tiny", "fake")]
    assert captured > 0 and puts > 0
    cache.export.publish(cache.stats, cache.faults.as_dict(), now=True)
    assert recorded.made["sglang:kamera_captured_chunks"].values[("tiny",)] == cache.stats.chunks_captured
    assert (
        recorded.made["sglang:kamera_store_tier_puts"].values[("tiny", "fake")]
        == store.stats().tiers["fake"].puts
    )
    assert recorded.made["sglang:kamera_store_tier_get_seconds"].labelnames == ["model_name", "tier"]
