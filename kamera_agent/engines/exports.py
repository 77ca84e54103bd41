"""kamera's counters on an engine's own Prometheus endpoint: one table, one report, any engine.

Why one module: vLLM and SGLang both export through ``prometheus_client`` classes they hand in
(their multiprocess-safe ones), and both get their numbers as differences, sent from where they
are counted to where they are exported. So the report (`Reports.since`: what grew), its sum
(`add_reports`, over ranks and steps) and the counters it feeds (`EngineCounters`) are written
once, each engine adding only its name prefix (``vllm:kamera_``, ``sglang:kamera_``) and labels.

A report is plain numbers (it crosses processes as msgpack)::

    {"counts": {EngineStats field: n}, "faults": {"hook:Kind": n}, "tiers": {tier: {name: change}}}

The tier part is `kamera_agent.store.instrumented.tier_series`, the series ``kamera serve``
exports, with no code per tier: each process sends what its store's tiers did since its last
report (`StoreRegistry.tier_growth`: once per store, where an engine's parts share one), so a
tier's counts are summed over the processes (tensor-parallel ranks) and so is a reported number
(``up`` reads 2 on two ranks whose tier answers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from kamera_agent.engines.load_plan import EngineStats
from kamera_agent.store.instrumented import tier_series

__all__ = [
    "COUNTERS",
    "ENGINE_COUNTERS",
    "FAULTS",
    "EngineCounters",
    "Reports",
    "add_reports",
    "is_empty",
    "reduce_report",
]

COUNTERS: dict[str, tuple[str, str]] = {
    "offered": ("offered_requests", "Requests kamera's store offered tokens to."),
    "tokens_offered": ("offered_tokens", "Prompt tokens kamera offered (slots the engine allocated)."),
    "loads": ("loads", "Loads kamera wrote into the engine's KV cache."),
    "tokens_loaded": ("loaded_tokens", "Prompt tokens kamera wrote from its store."),
    "chunks_loaded": ("loaded_chunks", "Chunk pieces kamera wrote from its store."),
    "failed": ("failed_loads", "Loads kamera gave up: the engine computed those tokens."),
    "chunks_captured": ("captured_chunks", "Chunk states kamera captured from the engine's prefills."),
    "tokens_kept": ("kept_tokens", "Prompt tokens kamera offered in kept (approximate) states."),
    "kept_refused": (
        "refused_kept",
        "Requests whose kept states nothing vouched for within the drift budget (the engine computed them).",
    ),
    "captures_dropped": (
        "dropped_captures",
        "Captures kamera dropped: its background writer's queue was full.",
    ),
}
"""A stats field -> (its series' name after the engine's prefix, without ``_total``; help text)."""
ENGINE_COUNTERS = [f.name for f in fields(EngineStats)]
"""The `COUNTERS` every engine adapter counts (the rest are one engine's own)."""
FAULTS = ("faults", "Faults caught at a kamera hook (the request went on without).")

_COUNTS, _FAULTS, _TIERS = "counts", "faults", "tiers"


class Reports:
    """What one counting part has reported so far: each report is the difference since the last."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._faults: dict[str, int] = {}

    def since(
        self, stats: EngineStats, faults: dict[str, int], tiers: dict[str, dict[str, float]] | None = None
    ) -> dict[str, Any] | None:
        """The counts that grew since the last call, with ``tiers``, what the store's tiers did
        since (`StoreRegistry.tier_growth`); ``None``: nothing did, nothing need be sent."""
        now = dict(vars(stats))  # flat ints: `dataclasses.asdict` copies deeply, on every step
        counts = _grown(now, self._counts)
        grown = _grown(faults, self._faults)
        if not counts and not grown and not tiers:
            return None
        self._counts, self._faults = now, dict(faults)
        return {_COUNTS: counts, _FAULTS: grown, _TIERS: tiers or {}}


def _grown(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: n - before.get(key, 0) for key, n in now.items() if n != before.get(key, 0)}


def add_reports(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """The sum of two reports (of two ranks, or of one part's successive steps)."""
    mine, theirs = a.get(_TIERS) or {}, b.get(_TIERS) or {}
    tiers = {tier: _sum(mine.get(tier, {}), theirs.get(tier, {})) for tier in mine.keys() | theirs.keys()}
    parts = {part: _sum(a.get(part) or {}, b.get(part) or {}) for part in (_COUNTS, _FAULTS)}
    return {**parts, _TIERS: tiers}


def _sum(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in a.keys() | b.keys()}


def reduce_report(report: Mapping[str, Any]) -> dict[str, int | float]:
    """One flat mapping of a report, for a log line: counts, ``faults[hook:Kind]``, ``tier.name``."""
    tiers = {
        f"{tier}.{name}": round(n, 3)
        for tier, numbers in (report.get(_TIERS) or {}).items()
        for name, n in numbers.items()
    }
    faults = {f"faults[{key}]": n for key, n in (report.get(_FAULTS) or {}).items()}
    return {**(report.get(_COUNTS) or {}), **faults, **tiers}


def is_empty(report: Mapping[str, Any]) -> bool:
    """Nothing in ``report`` grew."""
    return not any(any((report.get(part) or {}).values()) for part in (_COUNTS, _FAULTS, _TIERS))


class EngineCounters:
    """kamera's series on an engine's endpoint, fed reports (`observe`).

    Args:
        prefix: the series' name prefix (``"vllm:kamera_"``).
        metric: the engine's metric classes by kind (``"counter"``, ``"gauge"``): each called
            with ``name``, ``documentation``, ``labelnames`` (and a gauge ``multiprocess_mode``).
        labelnames: the engine's labels, the same on every series.
        labelvalues: per engine index, its label values.
        counters: the `COUNTERS` this engine counts (default: all), present at 0 from the start.
    """

    def __init__(
        self,
        prefix: str,
        metric: Mapping[str, Callable[..., Any]],
        labelnames: list[str],
        labelvalues: Mapping[int, list[object]],
        counters: list[str] | None = None,
    ) -> None:
        self._prefix, self._metric, self._labelnames = prefix, metric, labelnames
        self._labelvalues = labelvalues
        self._counters = {
            field: self._series(name, "counter", doc)
            for field, (name, doc) in COUNTERS.items()
            if counters is None or field in counters
        }
        for counter in self._counters.values():  # one child per engine: a counter reads 0, not absent
            for values in labelvalues.values():
                counter.labels(*values)
        self._faults = self._series(FAULTS[0], "counter", FAULTS[1], ["hook", "kind"])
        self._tiers: dict[str, Any] = {}  # made as a tier first names them
        self._gauges: dict[tuple[int, str, str], float] = {}  # the sums the tier gauges are set to

    def observe(self, report: Mapping[str, Any], engine: int = 0) -> None:
        """Add one report (`Reports.since`, or a sum of them) to engine ``engine``'s series."""
        labels = self._labelvalues[engine]
        for field, n in (report.get(_COUNTS) or {}).items():
            if field in self._counters and n > 0:
                self._counters[field].labels(*labels).inc(n)
        for key, n in (report.get(_FAULTS) or {}).items():
            hook, _, kind = str(key).partition(":")
            if n > 0:
                self._faults.labels(*labels, hook, kind).inc(n)
        for series in tier_series(report.get(_TIERS) or {}):
            if series.name not in self._tiers:
                self._tiers[series.name] = self._series(series.name, series.kind, series.help, ["tier"])
            for tier, n in series.values.items():
                child = self._tiers[series.name].labels(*labels, tier)
                if series.kind == "counter":
                    child.inc(max(n, 0.0))
                else:
                    key = (engine, series.name, tier)
                    self._gauges[key] = self._gauges.get(key, 0.0) + n
                    child.set(self._gauges[key])

    def _series(self, name: str, kind: str, doc: str, more: list[str] | None = None) -> Any:
        extra = {"multiprocess_mode": "mostrecent"} if kind == "gauge" else {}
        labelnames = [*self._labelnames, *(more or [])]
        return self._metric[kind](
            name=f"{self._prefix}{name}", documentation=doc, labelnames=labelnames, **extra
        )
