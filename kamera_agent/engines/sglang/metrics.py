"""kamera's series on SGLang's ``/metrics`` (``--enable-metrics``): ``sglang:kamera_*``.

SGLang runs each scheduler in its own process and exports what those processes count through
``prometheus_client``'s multiprocess mode: a counter a scheduler process makes and increments is
read by the HTTP server's ``/metrics``. So the cache publishes its counts there itself: as
requests are released, at most once every `PUBLISH_EVERY` seconds, what grew since the last
publish (`kamera_agent.engines.exports`: the counters of `EngineStats`, the faults caught at the
hooks, and every store tier's series, with no code per tier), labelled like SGLang's own
radix-cache series (``model_name``, ``tp_rank``, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from kamera_agent.engines.exports import ENGINE_COUNTERS, EngineCounters, Reports
from kamera_agent.engines.load_plan import EngineStats
from kamera_agent.engines.stores import STORES
from kamera_agent.store import ChunkStore

__all__ = ["PREFIX", "PUBLISH_EVERY", "CacheExport"]

PREFIX = "sglang:kamera_"
"""The name prefix of kamera's series on SGLang's ``/metrics``."""
PUBLISH_EVERY = 1.0
"""Seconds between two publishes: a scrape sees counts this old at most (while requests end)."""


class CacheExport:
    """What one cache publishes on SGLang's ``/metrics``.

    Args:
        store: the cache's store (its tiers' series: `StoreRegistry.tier_growth`).
        labels: SGLang's labels for this scheduler's radix-cache series.
        metric: the metric classes by kind (``"counter"``, ``"gauge"``; default:
            ``prometheus_client``'s, which SGLang's multiprocess mode collects).
        every: seconds between publishes.
    """

    def __init__(
        self,
        store: ChunkStore,
        labels: Mapping[str, str],
        metric: Mapping[str, Callable[..., Any]] | None = None,
        every: float = PUBLISH_EVERY,
    ) -> None:
        if metric is None:
            from prometheus_client import Counter, Gauge

            metric = {"counter": Counter, "gauge": Gauge}
        self._series = EngineCounters(
            PREFIX, metric, list(labels), {0: list(labels.values())}, ENGINE_COUNTERS
        )
        self._store, self._every = store, every
        self._reports = Reports()
        self._last = float("-inf")

    def publish(self, stats: EngineStats, faults: dict[str, int], *, now: bool = False) -> None:
        """Add what grew since the last publish, unless that was under ``every`` seconds ago
        (``now``: publish anyway)."""
        clock = time.monotonic()
        if not now and clock - self._last < self._every:
            return
        self._last = clock
        report = self._reports.since(stats, faults, STORES.tier_growth(self._store))
        if report is not None:
            self._series.observe(report)
