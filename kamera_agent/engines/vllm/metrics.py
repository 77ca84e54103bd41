"""kamera's connector counters on vLLM's own metrics path (``/metrics`` of ``vllm serve``).

vLLM 0.32 carries a connector's telemetry from where it happens to the API server: after each
step every worker's connector answers ``get_kv_connector_stats()`` (vLLM sums the workers'
answers with `KameraConnectorStats.aggregate`), the scheduler's connector adds its own, and the
joined ``to_dict()`` travels in the step's ``SchedulerStats.kv_connector_stats``; in the API
server the object `KameraConnector.build_prom_metrics` made (`KameraPromMetrics`) adds it to
Prometheus counters, and vLLM's logging stat logger prints ``reduce()`` ("KV Transfer metrics").

So each side reports what it counted since its last report (`Reports.since`), never a total:
the scheduler side counts offers, the worker side loads, failed loads and captures, both count
the faults caught at their hooks. Under tensor parallelism the workers' counts are summed over
ranks (each rank loads and captures its own piece of a chunk).

Exported (labelled with vLLM's ``model_name`` and ``engine``; counters but the tiers' reports):

==================================== ==================================================
``vllm:kamera_offered_requests_total``  requests the store offered tokens to
``vllm:kamera_offered_tokens_total``    tokens offered (vLLM allocated blocks for them)
``vllm:kamera_loads_total``             loads written into vLLM's blocks
``vllm:kamera_loaded_tokens_total``     tokens written from the store
``vllm:kamera_loaded_chunks_total``     chunk pieces written
``vllm:kamera_failed_loads_total``      loads given up (vLLM computed those blocks)
``vllm:kamera_captured_chunks_total``   chunk states captured from vLLM's prefills
``vllm:kamera_kept_tokens_total``       tokens offered in kept (approximate) states
``vllm:kamera_refused_kept_total``      requests whose kept states the drift budget refused
``vllm:kamera_dropped_captures_total``  captures dropped: the background writer's queue was full
``vllm:kamera_faults_total``            faults caught at a hook (labels ``hook``, ``kind``)
``vllm:kamera_store_tier_<field>_total`` each store tier's counts and seconds (label ``tier``)
``vllm:kamera_store_tier_<name>``       what each tier reports (``up``, ``pending_bytes``; gauges)
==================================== ==================================================

The table, the report and the counters are the engine-neutral `kamera_agent.engines.exports`
(SGLang's plugin exports the same series as ``sglang:kamera_*``); the tier series are the ones
``kamera serve`` exports, with no code per tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kamera_agent.engines.exports import (
    EngineCounters,
    Reports,
    add_reports,
    is_empty,
    reduce_report,
)
from kamera_agent.engines.load_plan import EngineStats

__all__ = ["PREFIX", "ConnectorStats", "KameraConnectorStats", "KameraPromMetrics", "Reports"]

PREFIX = "vllm:kamera_"
"""The name prefix of kamera's series on ``vllm serve``'s ``/metrics``."""


@dataclass
class ConnectorStats(EngineStats):
    """`EngineStats` and what only the vLLM connector counts.

    Attributes:
        captures_dropped: captures dropped on the step because the background writer's queue
            was full (`kamera_agent.engines.vllm.captures`): a later forward pays for them.
    """

    captures_dropped: int = 0


@dataclass
class KameraConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """One report of counts since the last (``data``: a `kamera_agent.engines.exports` report,
    plain numbers: it crosses processes as msgpack)."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.data = add_reports(self.data, {})

    @classmethod
    def of(cls, data: dict[str, Any] | None = None) -> KameraConnectorStats:
        """A report of ``data`` as vLLM passes it back (``None``: an empty one), copied."""
        return cls(data=dict(data or {}))

    def reset(self) -> None:
        self.data = add_reports({}, {})

    def aggregate(self, other: KVConnectorStats) -> KameraConnectorStats:
        """The sum of both reports (another connector's stats are ignored)."""
        if not isinstance(other, KameraConnectorStats):
            return self
        return KameraConnectorStats(data=add_reports(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return reduce_report(self.data)

    def is_empty(self) -> bool:
        return is_empty(self.data)


class KameraPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """kamera's counters (`EngineCounters`), registered through the metric classes vLLM hands in
    (its multiprocess-safe ones when the API server runs several processes)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        metric = {"counter": self._counter_cls, "gauge": self._gauge_cls}
        self._series = EngineCounters(PREFIX, metric, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._series.observe(transfer_stats_data, engine_idx)
