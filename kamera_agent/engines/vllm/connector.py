"""`KameraConnector`: a vLLM ``KVConnectorBase_V1`` that loads relocated chunk KV past vLLM's prefix hit.

Past vLLM's own prefix hit, the longest run of a request's chunks (messages, images) whose states
kamera's store holds is loaded into vLLM's blocks, each rotated to its positions in this request,
and every prompt chunk a forward computes is captured into the store under the state it has.

This class is a facade and holds no logic: each hook hands its call to the half of the process
it runs in (`Sides`, as vLLM's ``OffloadingConnector`` does), so each half reads as one side of
vLLM's contract and the halves are the template for an adapter of another engine
(docs/engines.md):

    scheduler's process ──► `ConnectorScheduler` (`kamera_agent.engines.vllm.scheduler`): plans
                            loads and captures, settles offers, reports each request
    each worker's process ──► `ConnectorWorker` (`kamera_agent.engines.vllm.worker`): loads,
                            captures, reports what it wrote and filed
    between them ──► `KameraMetadata` / `KameraWorkerMeta` (`kamera_agent.engines.vllm.common`)

What each step of a request does in any engine is `kamera_agent.engines.lifecycle`.

Settings (``kv_connector_extra_config``): ``{"config": {WindowConfig fields}}`` (default: the
exact settings). Exact serves only what a re-prefill computes; ``survivors="keep"`` also serves
moved chunks in the state they were captured in, to requests that carry a ``cache_salt``: loaded
blocks enter vLLM's prefix cache as if computed, so an approximation must stay under a salt its
clients chose (it namespaces kamera's chunks too); unsalted requests are served exactly.

Every per-request hook catches at its boundary (`HookFaults`): a fault in kamera's code costs
that request the reuse, never the request or the engine. Startup errors (a layout or a setting
kamera cannot use) raise where vLLM builds the connector. A load that finds its entry gone or
unreadable is a fault of its own (``LostEntry``, ``UnreadableEntry``, counted on
``vllm:kamera_faults_total``): its request is not offered again and the entry is not offered to
any request until filed anew (`kamera_agent.engines.offers`).

The scheduler and the worker see one store: in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
they share it; across processes (``vllm serve``) the settings' ``store_url``, or without one the
engines' default disk store of the machine (`kamera_agent.engines.stores`, docs/vllm.md).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from kamera_agent.engines.vllm.common import KameraMetadata, KameraWorkerMeta, Save
from kamera_agent.engines.vllm.loads import Load
from kamera_agent.engines.vllm.metrics import KameraConnectorStats, KameraPromMetrics
from kamera_agent.engines.vllm.scheduler import served_report
from kamera_agent.engines.vllm.sides import Sides
from kamera_agent.engines.vllm.worker import IDLE_WAIT

__all__ = [
    "IDLE_WAIT",
    "KameraConnector",
    "KameraMetadata",
    "KameraWorkerMeta",
    "Load",
    "Save",
    "served_report",
]


class KameraConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """kamera's chunk store as vLLM's external KV source: a facade over this process's half.

    It declares `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on: a model whose KV is
    one group of blocks (every layer full attention) is served as before; one split into several
    groups runs as vLLM alone would, kamera serving and capturing nothing.

    Attributes:
        sides: the half this process runs (`Sides.scheduler` or `Sides.worker`).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.sides = Sides.of(vllm_config, role, kv_cache_config)

    # -- scheduler side (`ConnectorScheduler`) ----------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.sides.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.sides.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KameraMetadata:
        return self.sides.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.sides.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.sides.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.sides.scheduler.request_finished_all_groups(request, block_ids)

    # -- worker side (`ConnectorWorker`) ----------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.sides.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self.sides.worker.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self.sides.worker.clear_connector_metadata()

    def has_connector_metadata(self) -> bool:
        return self.sides.worker.has_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.sides.worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.sides.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.sides.worker.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self.sides.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.sides.worker.get_finished(finished_req_ids)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self.sides.worker.handle_preemptions(kv_connector_metadata)

    def build_connector_worker_meta(self) -> KameraWorkerMeta | None:
        return self.sides.worker.build_connector_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.sides.worker.get_block_ids_with_load_errors()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every capture queued so far is in the store and every load started is done
        (`ConnectorWorker.flush`): what reads the store right after the engine's step calls."""
        return self.sides.worker.flush(timeout)

    # -- both sides -------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.sides.side.shutdown()

    def get_kv_connector_stats(self) -> KameraConnectorStats | None:
        return self.sides.side.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KameraConnectorStats:
        return KameraConnectorStats.of(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KameraPromMetrics:
        return KameraPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
