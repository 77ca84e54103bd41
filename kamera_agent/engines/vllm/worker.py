"""`ConnectorWorker`: the worker half of kamera's vLLM connector (it moves KV; it plans nothing).

Each worker process holds its rank's piece of vLLM's KV cache (`register_kv_caches`: every layer
of its pipeline stage, its tensor-parallel rank's heads). Each step it does what the scheduler
half's `KameraMetadata` says: its loads write relocated chunk KV into vLLM's blocks, and the
chunks the step's forward computed are captured into the store. The store's I/O stays off vLLM's
engine step: loads use vLLM's asynchronous-load contract and run on a thread
(`kamera_agent.engines.vllm.loads`); captures are copied out in the cache's dtype on the step
(on vLLM's CPU build, by the writer while vLLM holds the blocks) and filed by another thread
(`kamera_agent.engines.vllm.captures`). What it wrote, failed and filed goes back to the
scheduler half in `KameraWorkerMeta`.

Every hook catches at its boundary (`HookFaults`): a failed load is reported to vLLM as such (its
``kv_load_failure_policy`` computes the blocks), a missed capture costs a later forward.
"""

from __future__ import annotations

import threading
from collections import deque
from functools import partial
from typing import Any

import torch

from kamera_agent.engines.lifecycle import count_unloadable, count_written
from kamera_agent.engines.prefill_clock import PrefillClock
from kamera_agent.engines.shards import ShardedStore
from kamera_agent.engines.slots import request_positions
from kamera_agent.engines.vllm.blocks import BlockAddressingError, VLLMSlots, place_layers
from kamera_agent.engines.vllm.captures import CaptureWriter, Copied, HeldBlocks, copy_out
from kamera_agent.engines.vllm.common import LOG, ConnectorSide, Filed, KameraMetadata, KameraWorkerMeta, Save
from kamera_agent.engines.vllm.loads import BackgroundLoads, Load, LoadId
from kamera_agent.operator.layout import ChunkKV, KVLayout, to_position_free

__all__ = ["IDLE_WAIT", "ConnectorWorker"]

IDLE_WAIT = 0.01
"""Seconds a worker waits for its loads and copies in a step with nothing scheduled: long enough
for a local load to finish, short enough that a slow store only delays vLLM's next look."""


class ConnectorWorker(ConnectorSide):
    """The connector's hooks in one of vLLM's worker processes: load, capture, report."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, kv_cache_config)
        self._vllm_config = vllm_config
        self._connector_metadata: KameraMetadata | None = None
        self._pool = VLLMSlots([], self.layout)
        self.loads = BackgroundLoads(lambda load: self._load(load), self.faults, self.block_size)
        """The loads, run off the step (vLLM's asynchronous loads)."""
        self._load_errors: set[int] = set()
        self._written: set[LoadId] = set()
        self._failed: set[LoadId] = set()
        self.skipped_layers: list[str] = []
        """Registered caches that are no layer of the model (draft layers), skipped by name."""
        self.recent_loads: deque[Load] = deque(maxlen=256)
        """The latest loads (for checks of what it wrote)."""
        self.held = HeldBlocks()
        self.captures = CaptureWriter(lambda copied: self._file(copied), self.faults, copied=self.held.copied)
        """The background writer: captures are filed off the step."""
        self._filed: set[Filed] = set()
        self._filed_lock = threading.Lock()
        self.clock = PrefillClock(self.store.deadlines)
        """The forwards, timed: the store's deadlines scale with their time per token."""

    # -- startup ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map the caches to the model's layers by name and choose each one's layout from the
        attention backend vLLM runs it with; this rank's place in the grid decides which piece of
        each entry it reads and writes. Anything the connector cannot address fails here
        (`BlockAddressingError`), before the first step."""
        from vllm.model_executor.models.utils import extract_layer_index

        tp_rank, stage = _ranks()
        heads = self.grid.head_range(tp_rank)
        backends = _backend_names(self._vllm_config, list(kv_caches))
        placed, self.skipped_layers = place_layers(
            kv_caches, backends, self.layout, heads[1] - heads[0], extract_layer_index
        )
        if self.skipped_layers:
            LOG.warning(
                "kamera: %d KV cache layers are no layer of the model and are skipped by name "
                "(draft or unknown layers: %s)",
                len(self.skipped_layers),
                ", ".join(self.skipped_layers[:4]) + (" ..." if len(self.skipped_layers) > 4 else ""),
            )
        self._pool = VLLMSlots(placed, self.layout)
        if (self._pool.first, self._pool.end) != self.grid.stages[stage]:
            raise BlockAddressingError(
                f"pipeline stage {stage} registered KV caches of layers {self._pool.first}.."
                f"{self._pool.end - 1}, but vLLM's partition gives it {self.grid.stages[stage]}; "
                "kamera's entries need every layer of the stage"
            )
        # no `Splits` memory here: the scheduler side found the entry, this side must find it too
        self.synthesis.store = ShardedStore(self.store, self.grid, tp_rank, stage)

    # -- the step's metadata ----------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """vLLM hands the worker this step's metadata before the forward runs: the forward's
        clock starts (`PrefillClock`)."""
        self._connector_metadata = connector_metadata
        try:
            caches = self._pool.caches
            self.clock.began(caches[0].device if caches else None)
        except Exception as exc:  # an unmeasured step: the deadlines keep their last estimate
            self.faults.caught("bind_connector_metadata", exc)

    def clear_connector_metadata(self) -> None:
        """The step is over."""
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def _step(self) -> KameraMetadata:
        meta = self._connector_metadata
        assert isinstance(meta, KameraMetadata), "a step hook ran outside vLLM's step"
        return meta

    # -- loads ------------------------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Hand this step's loads to the background thread (`loads`): vLLM calls this after the
        step's forward is launched (no load feeds it) and schedules each request once
        `get_finished` names it."""
        self.loads.submit(self._step().loads)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The ended requests whose captured blocks are copied (vLLM frees them now) and the
        requests whose loads are done. Their written and failed loads and the blocks a failure
        left unwritten are reported in this same step (`build_connector_worker_meta`,
        `get_block_ids_with_load_errors`, which vLLM calls after this), as its contract asks.

        In a step with nothing scheduled the background threads are waited for (at most
        `IDLE_WAIT` seconds): returning at once, vLLM's loop steps again and again, and that
        Python thread holding the interpreter starves the loader."""
        meta = self._connector_metadata
        if getattr(meta, "idle", False):
            self.loads.flush(IDLE_WAIT)
            self.captures.flush(IDLE_WAIT)
        done = self.loads.take()
        self.stats.failed += len(done.failed)  # an entry gone, damaged or unwritable: vLLM recomputes
        self._written |= done.written
        self._failed |= done.failed
        self._load_errors |= done.errors
        self.held.forget(getattr(meta, "unheld", ()))  # freed at their end: never reported
        copied = self.held.released(finished_req_ids)
        return copied or None, done.finished or None

    def _load(self, load: Load) -> bool:
        """On the loader's thread: one load into vLLM's blocks (``False``: not written; an entry
        gone or unreadable is a fault of its own kind, counted)."""
        if load.entry is None:
            return False
        kv = self.synthesis.read(load.entry)
        if kv is None or kv.num_tokens < load.entry_to:
            count_unloadable(self.faults, self.synthesis.store, "start_load_kv", load.req_id, [load.entry])
            return False
        a, b = load.entry_from, load.entry_to
        part = ChunkKV(kv.keys[:, :, a:b], kv.values[:, :, a:b], None, kv.chunk_key)
        positions = _positions(self.layout, load.positions, load.start, load.start + b - a)
        self._pool.write(part, positions, torch.tensor(load.slots, dtype=torch.long))
        count_written(self.stats, b - a)
        self.recent_loads.append(load)
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a loaded request runs only after its loads are reported done."""

    # -- captures ---------------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Captures read every layer at once after the forward (``wait_for_save``)."""

    def wait_for_save(self) -> None:
        """Copy the blocks of each captured chunk out of vLLM's caches in the cache's dtype and
        queue them for the background writer (`kamera_agent.engines.vllm.captures`): no store
        I/O, no device sync."""
        meta = self._step()
        try:
            self.clock.ended(meta.tokens)  # the forward is done: its time per token, for the deadlines
        except Exception as exc:  # an unmeasured step: the deadlines keep their last estimate
            self.faults.caught("wait_for_save.clock", exc)
        if self.copies_off_step:  # every request the scheduler side holds, whatever fails below
            self.held.hold(save.req_id for save in meta.saves)
        for save in meta.saves:
            try:
                self._capture(save)
            except Exception as exc:  # a capture missed costs a later forward, no more
                self.faults.caught("wait_for_save", exc)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before this step's forward reuses preempted requests' blocks: their queued copies are
        made now, on the step (rare: what a preemption costs)."""
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if preempted and self.copies_off_step:
            self.captures.copy_now(preempted)

    def _capture(self, save: Save) -> None:
        blocks, rows = self._located(save)
        if self.copies_off_step:  # the writer copies the blocks while vLLM holds them
            size = blocks.numel() * self._pool.block_bytes
            copy = partial(self._pool.copy, blocks)
            deferred = Copied(
                save.entry,
                save.start,
                save.end,
                (),
                rows,
                copy=copy,
                size=size,
                req_id=save.req_id,
                positions=save.positions,
            )
            self.held.queued(save.req_id)
            if not self.captures.submit(deferred):
                self.held.copied(save.req_id)
                self.stats.captures_dropped += 1
            return
        copies, ready = copy_out(self._pool.copy(blocks))
        copied = Copied(save.entry, save.start, save.end, copies, rows, ready, positions=save.positions)
        if not self.captures.submit(copied):
            self.stats.captures_dropped += 1

    def _located(self, save: Save) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks of the cache views holding the save's tokens and their rows (`VLLMSlots.locate`)."""
        if not save.blocks:
            return self._pool.locate(torch.tensor(save.slots, dtype=torch.long))
        blocks, n = torch.tensor(save.blocks, dtype=torch.long), save.end - save.start
        if self._pool.block_size == self.block_size:  # a request's blocks are distinct: consecutive rows
            return blocks, torch.arange(save.offset, save.offset + n)
        # vLLM split each of its blocks into kernel blocks: the same slots address them
        slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()
        return self._pool.locate(slots[save.offset : save.offset + n])

    def _file(self, copied: Copied) -> None:
        """On the writer's thread: what the step copied, position-free in float32, into the store."""
        positions = _positions(self.layout, copied.positions, copied.start, copied.end)
        keys, values = self._pool.unpack(copied.blocks, copied.rows)
        kv = ChunkKV(keys.float(), values.float(), positions, copied.entry.key)
        self.synthesis.write(copied.entry, to_position_free(kv, self.layout))
        store = self.synthesis.store
        filed = store.filed_as(copied.entry) if isinstance(store, ShardedStore) else copied.entry
        self.stats.chunks_captured += 1
        if filed is not None:
            with self._filed_lock:
                self._filed.add((filed.kind, filed.key, filed.variant))

    # -- reports ----------------------------------------------------------------------------
    def build_connector_worker_meta(self) -> KameraWorkerMeta | None:
        """This step's loads, written and failed, and the entries filed since the last report,
        for the scheduler side's record."""
        with self._filed_lock:
            filed, self._filed = self._filed, set()
        copies = self.held.take_copies()
        if not self._written and not self._failed and not filed and not copies:
            return None
        report = KameraWorkerMeta(self._written, self._failed, filed, copies)
        self._written, self._failed = set(), set()
        return report

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every capture queued so far is in the store and every load started is done
        (at most ``timeout`` seconds each); whether they are. What reads the store right after
        the engine's step calls this."""
        return self.captures.flush(timeout) & self.loads.flush(timeout)

    def shutdown(self) -> None:
        """vLLM's worker is shutting down: finish the loads, file the queued captures, then flush
        the store."""
        try:
            self.loads.close()
            self.captures.close()
        except Exception as exc:  # shutdown goes on; the captures left are later forwards' cost
            self.faults.caught("shutdown", exc)
        super().shutdown()


def _positions(layout: KVLayout, rows: torch.Tensor | None, start: int, end: int) -> torch.Tensor:
    """Request tokens ``start..end``'s positions: their M-RoPE ``rows``, else their indices."""
    return request_positions(layout, start, end) if rows is None else rows


def _backend_names(vllm_config: Any, names: list[str]) -> dict[str, str]:
    """Each layer's attention backend (``get_name()``) as vLLM built it; where vLLM has no layer
    objects (a harness without a model), the backend its selector picks for this model."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, names)  # type: ignore[type-abstract]
    fallback = None if len(layers) == len(names) else get_current_attn_backends(vllm_config)[0].get_name()
    return {n: layers[n].get_attn_backend().get_name() if n in layers else str(fallback) for n in names}


def _ranks() -> tuple[int, int]:
    """This worker's tensor-parallel rank and pipeline stage (``(0, 0)`` outside vLLM's groups)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 0
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pp_group().rank_in_group
