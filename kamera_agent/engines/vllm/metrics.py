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

Exported (every one a counter, labelled with vLLM's ``model_name`` and ``engine``):

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
==================================== ==================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kamera_agent.engines.load_plan import EngineStats

__all__ = ["COUNTERS", "ConnectorStats", "KameraConnectorStats", "KameraPromMetrics", "Reports"]


@dataclass
class ConnectorStats(EngineStats):
    """`EngineStats` and what only the vLLM connector counts.

    Attributes:
        captures_dropped: captures dropped on the step because the background writer's queue
            was full (`kamera_agent.engines.vllm.captures`): a later forward pays for them.
    """

    captures_dropped: int = 0


COUNTERS: dict[str, tuple[str, str]] = {
    "offered": ("vllm:kamera_offered_requests", "Requests kamera's store offered tokens to."),
    "tokens_offered": ("vllm:kamera_offered_tokens", "Prompt tokens kamera offered (blocks vLLM allocated)."),
    "loads": ("vllm:kamera_loads", "Loads kamera wrote into vLLM's KV blocks."),
    "tokens_loaded": ("vllm:kamera_loaded_tokens", "Prompt tokens kamera wrote from its store."),
    "chunks_loaded": ("vllm:kamera_loaded_chunks", "Chunk pieces kamera wrote from its store."),
    "failed": ("vllm:kamera_failed_loads", "Loads kamera gave up: vLLM computed those blocks."),
    "chunks_captured": ("vllm:kamera_captured_chunks", "Chunk states kamera captured from vLLM's prefills."),
    "tokens_kept": ("vllm:kamera_kept_tokens", "Prompt tokens kamera offered in kept (approximate) states."),
    "kept_refused": (
        "vllm:kamera_refused_kept",
        "Requests whose kept states no audit vouched for within the drift budget (vLLM computed them).",
    ),
    "captures_dropped": (
        "vllm:kamera_dropped_captures",
        "Captures kamera dropped: its background writer's queue was full.",
    ),
}
"""`ConnectorStats` field -> (Prometheus name without ``_total``, help text)."""
FAULTS = ("vllm:kamera_faults", "Faults caught at a kamera connector hook (the request went on without).")

_COUNTS, _FAULTS = "counts", "faults"


@dataclass
class KameraConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """One report of counts since the last (``data``: ``{"counts": {field: n}, "faults":
    {"hook:Kind": n}}``, plain ints: it crosses processes as msgpack)."""

    def __post_init__(self) -> None:
        self.data.setdefault(_COUNTS, {})
        self.data.setdefault(_FAULTS, {})

    @classmethod
    def of(cls, data: dict[str, Any] | None = None) -> KameraConnectorStats:
        """A report of ``data`` as vLLM passes it back (``None``: an empty one), copied."""
        return cls(data=dict(data or {}))

    def reset(self) -> None:
        self.data: dict[str, Any] = {_COUNTS: {}, _FAULTS: {}}

    def aggregate(self, other: KVConnectorStats) -> KameraConnectorStats:
        """The sum of both reports (another connector's stats are ignored)."""
        if not isinstance(other, KameraConnectorStats):
            return self
        return KameraConnectorStats(
            data={part: _sum(self.data[part], other.data[part]) for part in (_COUNTS, _FAULTS)}
        )

    def reduce(self) -> dict[str, int | float]:
        return {**self.data[_COUNTS], **{f"faults[{key}]": n for key, n in self.data[_FAULTS].items()}}

    def is_empty(self) -> bool:
        return not any(self.data[_COUNTS].values()) and not any(self.data[_FAULTS].values())


def _sum(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in a.keys() | b.keys()}


class Reports:
    """What one connector side has reported so far: each report is the difference since the last."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._faults: dict[str, int] = {}

    def since(self, stats: EngineStats, faults: dict[str, int]) -> KameraConnectorStats | None:
        """The counts that grew since the last call (``None``: nothing did, vLLM sends nothing)."""
        now = dict(vars(stats))  # flat ints: no deep copy (`dataclasses.asdict`) on every step
        counts = _grown(now, self._counts)
        grown = _grown(faults, self._faults)
        if not counts and not grown:
            return None
        self._counts, self._faults = now, dict(faults)
        return KameraConnectorStats(data={_COUNTS: counts, _FAULTS: grown})


def _grown(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: n - before.get(key, 0) for key, n in now.items() if n != before.get(key, 0)}


class KameraPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """kamera's counters, registered through the metric classes vLLM hands in (its
    multiprocess-safe ones when the API server runs several processes)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        self._counters = {  # one child per engine from the start: a counter reads 0, not absent
            name: create_metric_per_engine(
                self._counter_cls(name=metric, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, (metric, doc) in COUNTERS.items()
        }
        self._faults = self._counter_cls(
            name=FAULTS[0], documentation=FAULTS[1], labelnames=[*labelnames, "hook", "kind"]
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, n in (transfer_stats_data.get(_COUNTS) or {}).items():
            if name in self._counters and n > 0:
                self._counters[name][engine_idx].inc(n)
        labels = self.per_engine_labelvalues[engine_idx]
        for key, n in (transfer_stats_data.get(_FAULTS) or {}).items():
            hook, _, kind = str(key).partition(":")
            if n > 0:
                self._faults.labels(*labels, hook, kind).inc(n)
