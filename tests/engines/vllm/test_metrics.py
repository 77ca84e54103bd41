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
    assert first is not None
    assert first.data == {
        "counts": {"loads": 2, "tokens_loaded": 64},
        "faults": {"start_load_kv:KeyError": 1},
    }
    assert reports.since(stats, {"start_load_kv:KeyError": 1}) is None
    stats.loads += 1
    again = reports.since(stats, {"start_load_kv:KeyError": 1})
    assert again is not None and again.data == {"counts": {"loads": 1}, "faults": {}}


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
