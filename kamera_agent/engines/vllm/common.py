"""What both halves of kamera's vLLM connector share: their setup and the metadata between them.

vLLM builds a connector once per role: in the scheduler's process (role ``SCHEDULER``: it plans,
`kamera_agent.engines.vllm.scheduler`) and in every worker's (role ``WORKER``: it loads and
captures, `kamera_agent.engines.vllm.worker`). Both open the same store from the same settings
(`ConnectorSide`) and speak through two messages per step:

    scheduler ──`KameraMetadata`: loads, saves (`Save`), preemptions──► workers
    scheduler ◄──`KameraWorkerMeta`: loads written / failed, entries filed, copies made── workers
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kamera_agent.config import WindowConfig
from kamera_agent.engines.faults import HookFaults
from kamera_agent.engines.shards import Grid, ShardedStore
from kamera_agent.engines.stores import STORES
from kamera_agent.engines.synthesis import PrefixSynthesis, serving
from kamera_agent.engines.vllm.loads import Load, LoadId
from kamera_agent.engines.vllm.metrics import ConnectorStats, KameraConnectorStats, Reports
from kamera_agent.operator.layout import KVLayout
from kamera_agent.store import EntryKey

__all__ = ["LOG", "ConnectorSide", "Filed", "KameraMetadata", "KameraWorkerMeta", "Save"]

LOG = logging.getLogger("kamera_agent.engines.vllm.connector")
"""One logger for both halves: operators filter kamera's connector by one name."""


@dataclass(frozen=True)
class Save:
    """One chunk to capture after the forward: request tokens ``start..end`` into ``entry``, at
    ``slots``, or (what the scheduler side sends: no per-token list built or read on a step) in
    ``blocks`` from row ``offset`` of the first on, consecutively."""

    req_id: str
    entry: EntryKey
    start: int
    end: int
    slots: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()
    offset: int = 0
    positions: torch.Tensor | None = field(default=None, compare=False)
    """The tokens' M-RoPE positions ``[3, end - start]``; ``None``: their indices."""


@dataclass
class KameraMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler side asks the worker side to do in one step."""

    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    """Requests vLLM preempted in this step: their blocks are reused by this step's forward."""
    unheld: set[str] = field(default_factory=set)
    """Requests that ended with every copy of their blocks reported made: freed at once, so the
    workers release them no more (`HeldBlocks.forget`)."""
    idle: bool = False
    """Nothing is scheduled this step (every request waits, e.g. for its loads): the workers may
    wait for their background threads instead of returning to a step loop that would only spin
    (`ConnectorWorker.get_finished`)."""
    tokens: int = 0
    """Tokens the step's forward computes (its prefill time per token sets the store's deadlines)."""


Filed = tuple[str, str, str]
"""An entry a worker filed, as ``(kind, key, variant)`` (plain strings: it crosses processes)."""


@dataclass
class KameraWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What the worker side did with one step's loads, sent back to the scheduler side (vLLM
    aggregates every worker's into one: a load some rank failed counts as failed)."""

    written: set[LoadId] = field(default_factory=set)
    failed: set[LoadId] = field(default_factory=set)
    filed: set[Filed] = field(default_factory=set)
    """Entries the workers' background writers filed since their last report: the scheduler side
    counts them present (`Splits.filed`) before the store it reads shows them."""
    copies: dict[str, int] = field(default_factory=dict)
    """Per request, the copies of its captured blocks made (or given up) off the step since the
    last report, summed over the workers: a request whose copies are all made is freed at its
    end without waiting (`ConnectorScheduler.request_finished`)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KameraWorkerMeta:
        if not isinstance(other, KameraWorkerMeta):
            return self
        copies = dict(self.copies)
        for req_id, n in other.copies.items():
            copies[req_id] = copies.get(req_id, 0) + n
        return KameraWorkerMeta(
            self.written | other.written, self.failed | other.failed, self.filed | other.filed, copies
        )


class ConnectorSide:
    """What either half sets up from vLLM's config: the settings, the model's KV layout, the
    store under the checkpoint's fingerprint, how vLLM splits KV over its ranks, the planner over
    them, and the counters it reports on vLLM's metrics path.

    Startup errors (an engine version outside the tested range, a layout or a setting kamera
    cannot use) raise here, where vLLM builds the connector.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any = None) -> None:
        import vllm

        from kamera_agent.backends.transformers.reading import kv_layout_of_config
        from kamera_agent.engines.versions import check_engine_version
        from kamera_agent.fingerprint import checkpoint_fingerprint

        check_engine_version("vllm", vllm.__version__)  # outside the tested range: fail at startup
        groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or [None])
        self.one_group = groups == 1
        """The model's KV is one group of blocks: what kamera's entries and loads address."""
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.config = WindowConfig(**extra.get("config", {})) if "config" in extra else WindowConfig.exact()
        model = vllm_config.model_config
        self.layout: KVLayout = kv_layout_of_config(model.hf_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.fingerprint = checkpoint_fingerprint(model.model, model.dtype)
        self.store = STORES.open(self.fingerprint, self.config)
        self.stats = ConnectorStats()
        self.faults = HookFaults(LOG)
        """Runtime faults caught at this side's hooks (``hook:ExceptionType`` -> count)."""
        self._reports = Reports()
        self.grid = _grid(self.layout, vllm_config)
        """How vLLM splits each chunk's KV over its ranks: entries are filed piece by piece."""
        mode, budget = serving(self.config, self.store, self.fingerprint)
        self.synthesis = PrefixSynthesis(ShardedStore(self.store, self.grid), mode, budget)
        self.copies_off_step = _copies_off_step(vllm_config)
        """Captures' blocks are copied by the writer, not on the step (vLLM's CPU build, where a
        copy is a real memory copy); vLLM then holds a request's blocks until they are."""

    def get_kv_connector_stats(self) -> KameraConnectorStats | None:
        """What this side counted since its last report, and what the store's tiers did
        (`kamera_agent.engines.vllm.metrics`): vLLM sums the workers', adds the scheduler's and
        exports them on ``/metrics``."""
        try:
            report = self._reports.since(self.stats, self.faults.as_dict(), STORES.tier_growth(self.store))
            return None if report is None else KameraConnectorStats(data=report)
        except Exception as exc:  # a report missed: the counters lag, nothing else
            self.faults.caught("get_kv_connector_stats", exc)
            return None

    def shutdown(self) -> None:
        """vLLM is shutting down: flush the store (its write-behind tiers)."""
        try:
            self.store.flush()
        except Exception as exc:  # shutdown goes on; what was not flushed is later forwards' cost
            self.faults.caught("shutdown", exc)


def _copies_off_step(vllm_config: Any) -> bool:
    """Whether captures' blocks are copied by the writer (the CPU build: a copy there is a memory
    copy on the step; on CUDA the step only launches an asynchronous one). Both sides decide the
    same from the same config."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
    return str(device) == "cpu"


def _grid(layout: KVLayout, vllm_config: Any) -> Grid:
    """The engine's split: KV heads over tensor-parallel ranks, layers over pipeline stages
    (vLLM's own partition, ``VLLM_PP_LAYER_PARTITION`` included)."""
    from vllm.distributed.utils import get_pp_indices

    parallel = vllm_config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    stages = [get_pp_indices(layout.num_layers, rank, pp) for rank in range(pp)]
    return Grid.of(layout, 1 if layout.kind == "mla" else tp, stages)
