"""kamera's connector counters on vLLM's metrics path, without an engine (`test_serve.py` reads
them from a real ``vllm serve``'s ``/metrics``)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kamera_agent.engines.synthesis import EngineStats
from kamera_agent.engines.vllm.connector import KameraConnector
from kamera_agent.engines.vllm.metrics import KameraConnectorStats, KameraPromMetrics, Reports

pytestmark = pytest.mark.vllm


def test_each_report_is_what_grew_since_the_last() -> None:
    stats, reports = EngineStats(), Reports()
    assert reports.since(stats, {}) is None  # nothing counted: vLLM sends nothing
    stats.loads, stats.tokens_loaded = 2, 64
    first = reports.since(stats, {"start_load_kv:KeyError": 1})
    assert first == {
        "counts": {"loads": 2, "tokens_loaded": 64},
        "faults": {"start_load_kv:KeyError": 1},
        "tiers": {},
    }
    assert reports.since(stats, {"start_load_kv:KeyError": 1}) is None
    stats.loads += 1
    again = reports.since(stats, {"start_load_kv:KeyError": 1})
    assert again == {"counts": {"loads": 1}, "faults": {}, "tiers": {}}


def test_workers_and_the_scheduler_are_summed() -> None:
    worker = KameraConnectorStats(data={"counts": {"loads": 2, "tokens_loaded": 64}, "faults": {}})
    other_rank = KameraConnectorStats(
        data={"counts": {"loads": 1}, "faults": {"wait_for_save:ValueError": 1}}
    )
    scheduler = KameraConnector.build_kv_connector_stats({"counts": {"offered": 1}, "faults": {}})
    total = worker.aggregate(other_rank).aggregate(scheduler)
    assert total.data["counts"] == {"loads": 3, "tokens_loaded": 64, "offered": 1}
    assert total.reduce() == {
        "loads": 3,
        "tokens_loaded": 64,
        "offered": 1,
        "faults[wait_for_save:ValueError]": 1,
    }
    assert worker.data["counts"]["loads"] == 2  # aggregate makes a new report
    assert KameraConnector.build_kv_connector_stats().is_empty() and not total.is_empty()


def test_the_counters_are_prometheus_counters_per_engine() -> None:
    registry = CollectorRegistry()
    types = {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    labels = {0: ["tiny", "0"]}
    metrics = KameraConnector.build_prom_metrics(config, types, ["model_name", "engine"], labels)
    assert isinstance(metrics, KameraPromMetrics)
    engine = {"model_name": "tiny", "engine": "0"}
    assert (
        registry.get_sample_value("vllm:kamera_loaded_tokens_total", engine) == 0.0
    )  # present from the start
    data = {"counts": {"tokens_loaded": 64, "chunks_captured": 3}, "faults": {"start_load_kv:KeyError": 2}}
    metrics.observe(data, 0)
    metrics.observe(data, 0)
    assert registry.get_sample_value("vllm:kamera_loaded_tokens_total", engine) == 128
    assert registry.get_sample_value("vllm:kamera_captured_chunks_total", engine) == 6
    faults = engine | {"hook": "start_load_kv", "kind": "KeyError"}
    assert registry.get_sample_value("vllm:kamera_faults_total", faults) == 4


def test_a_request_reports_what_it_was_served_and_a_failed_load_loaded_nothing() -> None:
    from kamera_agent.core.identity import ChunkState, Context
    from kamera_agent.engines.synthesis import LoadPlan, RequestChunk, Served
    from kamera_agent.engines.vllm.connector import served_report
    from kamera_agent.store import EntryKey

    root = Context.root("anchor")
    first, second = RequestChunk(32, 64, "a"), RequestChunk(64, 100, "b")
    computed_b = ChunkState.patched("b", "full", root.extend(ChunkState.canonical("a", root)))
    kept_b = ChunkState.patched("b", "full", root.extend(ChunkState.canonical("x", root)))
    served = (
        Served(first, ChunkState.canonical("a", root), EntryKey.canonical("a")),
        Served(second, kept_b, EntryKey.full("b", kept_b.digest), 0, computed_b, 0.02),
    )
    plan = LoadPlan(32, 96, served, held_kept=5, held_drift=0.01, refused=True)
    report = served_report(plan)["kamera"]
    assert report == {"loaded_tokens": 64, "kept_tokens": 32 + 5, "drift": 0.02, "kept_refused": True}
    failed = served_report(plan, failed=True)["kamera"]
    assert failed == {"loaded_tokens": 0, "kept_tokens": 5, "drift": 0.01, "kept_refused": True}
    assert served_report(None)["kamera"]["loaded_tokens"] == 0


def test_every_store_tier_reaches_vllm_metrics_without_code_of_its_own() -> None:
    registry = CollectorRegistry()
    types = {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    labels = {0: ["tiny", "0"]}
    metrics = KameraConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], labels
    )
    reports = Reports()
    report = reports.since(EngineStats(), {}, {"s3": {"hits": 2, "get_seconds": 0.5, "up": 1.0}})
    assert report is not None  # a tier's numbers alone are a report
    rank = KameraConnectorStats(data=report)
    other = KameraConnectorStats(data={"counts": {}, "faults": {}, "tiers": {"s3": {"hits": 1, "up": 1.0}}})
    total = rank.aggregate(other)
    assert total.data["tiers"] == {"s3": {"hits": 3, "get_seconds": 0.5, "up": 2.0}}  # summed over ranks
    assert total.reduce() == {"s3.hits": 3, "s3.get_seconds": 0.5, "s3.up": 2.0}
    metrics.observe(total.data, 0)
    metrics.observe({"tiers": {"s3": {"hits": 1, "up": -1.0}, "disk": {"misses": 4}}}, 0)
    tier = {"model_name": "tiny", "engine": "0", "tier": "s3"}
    assert registry.get_sample_value("vllm:kamera_store_tier_hits_total", tier) == 4
    assert registry.get_sample_value("vllm:kamera_store_tier_get_seconds_total", tier) == 0.5
    assert registry.get_sample_value("vllm:kamera_store_tier_up", tier) == 1.0  # a gauge: the changes' sum
    assert registry.get_sample_value("vllm:kamera_store_tier_misses_total", tier | {"tier": "disk"}) == 4
