"""`vllm serve` end to end: the OpenAI server with kamera's connector on a shared Valkey store.

Three servers of the tiny checkpoint run in turn (vLLM's CPU build, `serve.py`), each driven by
the official ``openai`` client through a sliding conversation and a RAG conversation whose
documents are reordered between turns, then each conversation's last request again after
``/reset_prefix_cache``:

- **alone**: ``vllm serve`` without a connector (the answers and token counts to match);
- **first**: the connector under the exact settings (``kv_connector_extra_config`` without
  ``config``), the store's URL, password included, from ``KAMERA_STORE_URL``;
- **second**: the connector on the same server, settings ``WindowConfig.exact(store_url=...)``
  given in ``config``: a fresh engine whose prefix cache holds nothing the first computed.

Token counts come from vLLM's own ``vllm:prompt_tokens_by_source`` on ``/metrics``; kamera's
counters (`kamera_agent.engines.vllm.metrics`) are read from the same endpoint.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines.vllm.serve import CONNECTOR, converse, valkey_with_password, vllm_serve
from tests.engines.vllm.test_connector import model_dir  # noqa: F401  (the tiny checkpoint fixture)

pytestmark = pytest.mark.vllm

EXACT = {"rank": "full", "survivors": "removal", "recall_context": "current", "cascade": "cascade"}
"""`WindowConfig.exact()`'s fields (with ``orbit: false``)."""
PARTS = ("sliding", "rag", "replay")


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:  # noqa: F811
    logs = tmp_path_factory.mktemp("vllm-serve")
    with valkey_with_password() as (client, url):
        runs: dict[str, Any] = {}
        with vllm_serve(model_dir, logs / "alone.log") as server:
            runs["alone"] = converse(server)
        first = CONNECTOR | {"kv_connector_extra_config": {}}
        with vllm_serve(model_dir, logs / "first.log", first, env={"KAMERA_STORE_URL": url}) as server:
            runs["first"] = converse(server)
        runs["keys_after_first"] = int(client.dbsize())
        second = CONNECTOR | {
            "kv_connector_extra_config": {"config": EXACT | {"orbit": False, "store_url": url}}
        }
        with vllm_serve(model_dir, logs / "second.log", second) as server:
            runs["second"] = converse(server)
        yield runs


def _tokens(run: dict[str, Any], part: str) -> list[list[int]]:
    return [r["tokens"] for r in run[part]]


def _sum(run: dict[str, Any], source: str, parts: tuple[str, ...] = PARTS) -> float:
    return sum(r[source] for part in parts for r in run[part])


def test_vllm_serve_with_the_connector_answers_as_vllm_serve_alone(served: dict[str, Any]) -> None:
    alone, first = served["alone"], served["first"]
    for part in PARTS:
        assert _tokens(first, part) == _tokens(alone, part), part
    # within one server, exact reuse past vLLM's own prefix cache needs that cache to lose the
    # blocks: after a reset the connector loads what it captured, vLLM alone computes it again
    assert all(r["external_kv_transfer"] > 0 for r in first["replay"]), first["replay"]
    assert _sum(first, "local_compute", ("replay",)) < _sum(alone, "local_compute", ("replay",))
    assert served["keys_after_first"] > 0  # captures reached the password-protected server
    print(
        "vllm serve, exact, one server: conversations computed "
        f"{_sum(first, 'local_compute', ('sliding', 'rag')):.0f} vs "
        f"{_sum(alone, 'local_compute', ('sliding', 'rag')):.0f} prompt tokens alone; after "
        f"/reset_prefix_cache the two last requests computed {_sum(first, 'local_compute', ('replay',)):.0f}"
        f" vs {_sum(alone, 'local_compute', ('replay',)):.0f}, "
        f"{_sum(first, 'external_kv_transfer', ('replay',)):.0f} loaded; answers equal in "
        f"{sum(len(alone[p]) for p in PARTS)}/{sum(len(alone[p]) for p in PARTS)}",
        file=sys.stderr,
    )


def test_the_connectors_counters_are_on_vllms_metrics_endpoint(served: dict[str, Any]) -> None:
    """Offers (the scheduler side), loads and captures (the worker side) reach ``/metrics`` and
    agree with vLLM's own count of tokens from external KV transfer; so do the store tiers'."""
    for name in ("first", "second"):
        run = served[name]
        counters = run["counters"]
        external = _sum(run, "external_kv_transfer")
        loaded = counters["vllm:kamera_loaded_tokens_total"]
        assert loaded == external == counters["vllm:kamera_offered_tokens_total"], (name, counters)
        assert counters["vllm:kamera_loads_total"] > 0 and counters["vllm:kamera_offered_requests_total"] > 0
        # the first captures what it computes; the second, asked the same, finds it all stored
        assert (counters["vllm:kamera_captured_chunks_total"] > 0) == (name == "first"), counters
        assert counters["vllm:kamera_failed_loads_total"] == 0, counters
        assert counters.get("vllm:kamera_faults_total", 0) == 0, counters
        # the shared tier's own series, from the store's one wrapper: the first wrote it, the second read it
        tier = "vllm:kamera_store_tier_puts_total" if name == "first" else "vllm:kamera_store_tier_hits_total"
        assert counters.get(tier, 0) > 0, counters
        print(
            f"/metrics of the {name} server: "
            + ", ".join(f"{k.removeprefix('vllm:kamera_')} {v:.0f}" for k, v in sorted(counters.items())),
            file=sys.stderr,
        )


def test_a_second_vllm_serve_serves_what_the_first_captured(served: dict[str, Any]) -> None:
    alone, second = served["alone"], served["second"]
    for part in PARTS:
        assert _tokens(second, part) == _tokens(alone, part), part
    # the first request of each conversation: nothing in this engine yet, the store has it all
    assert second["sliding"][0]["external_kv_transfer"] > 0 and second["rag"][0]["external_kv_transfer"] > 0
    assert second["counters"]["vllm:kamera_loaded_tokens_total"] > 0
    computed, computed_alone = _sum(second, "local_compute"), _sum(alone, "local_compute")
    assert computed < computed_alone
    print(
        f"two vllm serve on one Valkey server: the second computed {computed:.0f} prompt tokens "
        f"where vllm serve alone computed {computed_alone:.0f}, "
        f"{_sum(second, 'external_kv_transfer'):.0f} loaded "
        f"({second['counters']['vllm:kamera_loads_total']:.0f} loads); answers equal in "
        f"{sum(len(alone[p]) for p in PARTS)}/{sum(len(alone[p]) for p in PARTS)}",
        file=sys.stderr,
    )
