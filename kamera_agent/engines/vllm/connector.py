"""`KameraConnector`: a vLLM ``KVConnectorBase_V1`` that loads relocated chunk KV past vLLM's prefix hit.

vLLM's connector contract is prefix-shaped: the scheduler side says how many tokens after
vLLM's own cached prefix it can load (``get_num_new_matched_tokens``), vLLM allocates blocks for
them (``update_state_after_alloc``), and the worker side fills them before the forward
(``start_load_kv``); after each forward the worker may read what was computed (``wait_for_save``).
Here the loadable tokens are the longest run of the request's chunks (messages, images by
``mm_features``, named by their content: `kamera_agent.engines.vllm.images`) whose states
kamera's store holds (`kamera_agent.engines.synthesis`, the same planning SGLang's plugin uses),
each written rotated to its positions in this request; and every prompt chunk a forward computes
is captured into the store under the state it has. On an M-RoPE model a request with images has
the positions vLLM's own model code computes for it (`kamera_agent.engines.vllm.mrope`): the
scheduler side computes them once and sends each load's and capture's rows to the worker side.

The store's I/O stays off vLLM's engine step: loads use vLLM's asynchronous-load contract and
run on a thread (`kamera_agent.engines.vllm.loads`), captures are copied out in the cache's
dtype on the step and filed by another (`kamera_agent.engines.vllm.captures`); the workers
report what they filed, which the scheduler side counts as present (`ShardedStore`'s `Splits`).

Settings (``kv_connector_extra_config``): ``{"config": {WindowConfig fields}}`` (default: the
exact settings). Exact serves only what a re-prefill computes; ``survivors="keep"`` also serves
moved chunks in the state they were captured in, to requests that carry a ``cache_salt``: loaded
blocks enter vLLM's prefix cache as if computed, so an approximation must stay under a salt its
clients chose (it namespaces kamera's chunks too); unsalted requests are served exactly.

Every per-request hook catches at its boundary (`HookFaults`): a fault in kamera's code costs
that request the reuse, never the request or the engine (the scheduler side offers nothing, or
the blocks it offered are reported as load failures and vLLM computes them). Startup errors
(a layout or a setting kamera cannot use) raise where vLLM builds the connector.

A load that finds its entry gone or unreadable is a fault of its own (``LostEntry``,
``UnreadableEntry``, counted on ``vllm:kamera_faults_total``): its request is not offered again
(vLLM's ``recompute`` policy computes it at once) and the entry is not offered to any request
until filed anew (`kamera_agent.engines.offers`).

The scheduler and the worker see one store: in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
they share it; across processes (``vllm serve``) the settings' ``store_url``, or without one the
engines' default disk store of the machine (`kamera_agent.engines.stores`, docs/vllm.md).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kamera_agent.config import WindowConfig
from kamera_agent.engines.chunking import ChunkRules, request_chunks
from kamera_agent.engines.faults import HookFaults
from kamera_agent.engines.prefill_clock import PrefillClock
from kamera_agent.engines.shards import Grid, ShardedStore, Splits, unsharded
from kamera_agent.engines.slots import request_positions
from kamera_agent.engines.stores import STORES
from kamera_agent.engines.synthesis import LoadPlan, PrefixSynthesis, RequestChunk, serving
from kamera_agent.engines.vllm.blocks import BlockLayoutError, VLLMSlots, place_layers
from kamera_agent.engines.vllm.captures import CaptureWriter, Copied, HeldBlocks, copy_out
from kamera_agent.engines.vllm.images import ImageIdentities, images_only
from kamera_agent.engines.vllm.loads import BackgroundLoads, Load, LoadId
from kamera_agent.engines.vllm.metrics import ConnectorStats, KameraConnectorStats, KameraPromMetrics, Reports
from kamera_agent.engines.vllm.mrope import MRopePositions
from kamera_agent.operator.layout import ChunkKV, KVLayout, to_position_free
from kamera_agent.store import EntryKey

__all__ = ["KameraConnector", "KameraMetadata", "Load"]

_LOG = logging.getLogger(__name__)

IDLE_WAIT = 0.01
"""Seconds a worker waits for its loads and copies in a step with nothing scheduled: long enough
for a local load to finish, short enough that a slow store only delays vLLM's next look."""


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
    (`get_finished`)."""
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
    end without waiting (`request_finished`)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KameraWorkerMeta:
        if not isinstance(other, KameraWorkerMeta):
            return self
        copies = dict(self.copies)
        for req_id, n in other.copies.items():
            copies[req_id] = copies.get(req_id, 0) + n
        return KameraWorkerMeta(
            self.written | other.written, self.failed | other.failed, self.filed | other.filed, copies
        )


@dataclass(frozen=True)
class _Offered:
    """A load plan the scheduler side offered, recorded (`PrefixSynthesis.loaded`) only once the
    worker side reports every one of its loads written: under ``"keep"`` a recorded load names
    the state later requests find in vLLM's prefix, which a failed load never left there."""

    namespace: str
    chunks: list[RequestChunk]
    plan: LoadPlan
    loads: dict[LoadId, EntryKey]
    """Each load and the entry it reads."""


@dataclass
class _Track:
    """The scheduler side's view of one request."""

    namespace: str
    chunks: list[RequestChunk]
    prompt_len: int
    servable: bool
    salted: bool
    positions: torch.Tensor | None = None
    """Its prompt's M-RoPE positions ``[3, prompt_len]`` (a request with images on an M-RoPE
    model); ``None``: every token at its index."""
    plan: LoadPlan | None = None
    block_ids: list[int] = field(default_factory=list)
    saved: set[int] = field(default_factory=set)
    walked: int = 0
    """Prompt tokens already walked for captures (decode steps then cost nothing)."""
    copies: int = 0
    """Captures planned for it: where workers copy blocks off the step, each is a copy that must
    be made before its blocks are freed (`HeldBlocks`)."""
    copied: int = 0
    """Copies the workers reported made, summed over them."""
    load_failed: bool = False
    """A load of its offer failed on some worker: vLLM computes those tokens (`served_report`),
    and the request is not offered again."""


def served_report(plan: LoadPlan | None, failed: bool = False) -> dict[str, Any]:
    """What kamera served one request, under ``"kamera"`` (vLLM's ``kv_transfer_params`` of its
    output; ``vllm serve`` returns it in the response body): prompt tokens loaded from the store,
    tokens in kept states (approximations: loaded now, or left in vLLM's prefix cache by an
    earlier load), their largest estimated drift (``None``: unknown, kept unbounded), and
    whether a kept state was refused for want of an audit within the drift budget. A load that
    ``failed`` loaded nothing (vLLM computed those tokens): only what vLLM's cache held counts."""
    if plan is None:
        return {"kamera": {"loaded_tokens": 0, "kept_tokens": 0, "drift": 0.0, "kept_refused": False}}
    if failed:
        plan = LoadPlan(plan.device_len, plan.device_len, (), plan.held_kept, plan.held_drift, plan.refused)
    kept = plan.kept_tokens + plan.held_kept
    return {
        "kamera": {
            "loaded_tokens": plan.tokens,
            "kept_tokens": kept,
            "drift": plan.drift,
            "kept_refused": plan.refused,
        }
    }


class KameraConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """kamera's chunk store as vLLM's external KV source (both connector roles).

    It declares `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on: a model whose KV is
    one group of blocks (every layer full attention) is served as before; one split into several
    groups (sliding-window layers beside full ones, state layers) runs as vLLM alone would, with
    the manager on, kamera serving and capturing nothing (its entries are every layer's KV of a
    chunk in one group's blocks: per-group entries are not built).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        import vllm
        from transformers import AutoTokenizer

        from kamera_agent.engines.versions import check_engine_version

        check_engine_version("vllm", vllm.__version__)  # outside the tested range: fail at startup

        from kamera_agent.backends.transformers.reading import kv_layout_of_config
        from kamera_agent.fingerprint import checkpoint_fingerprint

        groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or [None])
        self.one_group = groups == 1
        """The model's KV is one group of blocks: what kamera's entries and loads address."""
        if not self.one_group:
            _LOG.warning(
                "kamera: this model's KV is split into %d cache groups (hybrid attention); the "
                "connector serves and captures nothing, vLLM runs as without it",
                groups,
            )
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = WindowConfig(**extra.get("config", {})) if "config" in extra else WindowConfig.exact()
        model = vllm_config.model_config
        self.layout: KVLayout = kv_layout_of_config(model.hf_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        fingerprint = checkpoint_fingerprint(model.model, model.dtype)
        self.store = STORES.open(fingerprint, self.config)
        self.stats = ConnectorStats()
        self.faults = HookFaults(_LOG)
        """Runtime faults caught at this side's hooks (``hook:ExceptionType`` -> count)."""
        self._reports = Reports()
        self.grid = _grid(self.layout, vllm_config)
        """How vLLM splits each chunk's KV over its ranks: entries are filed piece by piece."""
        self.splits = Splits()
        """The scheduler side's memory: the grids found holding pieces, the entries workers filed."""
        policy, budget = serving(self.config, self.store, fingerprint)
        self.synthesis = PrefixSynthesis(
            ShardedStore(self.store, self.grid, splits=self.splits), policy, budget
        )
        tokenizer = AutoTokenizer.from_pretrained(model.tokenizer) if model.tokenizer else None
        self.rules = ChunkRules.for_model(model.hf_config, tokenizer)
        self.images = ImageIdentities()
        self.mrope = MRopePositions.of_model(model) if self.layout.rope.axes is not None else None
        """vLLM's M-RoPE positions of a request with images (``None``: 1-D RoPE, positions are indices)."""
        self._requests: dict[str, _Track] = {}
        self._loads: list[Load] = []
        self._pool = VLLMSlots([], self.layout)
        self.loads = BackgroundLoads(lambda load: self._load(load), self.faults, self.block_size)
        """The worker side's loads, run off the step (vLLM's asynchronous loads)."""
        self._load_errors: set[int] = set()
        self._offered: dict[str, _Offered] = {}
        self._written: set[LoadId] = set()
        self._failed: set[LoadId] = set()
        self.skipped_layers: list[str] = []
        """Registered caches that are no layer of the model (draft layers), skipped by name."""
        self.recent_loads: deque[Load] = deque(maxlen=256)
        """The worker side's latest loads (for checks of what it wrote)."""
        self.copies_off_step = _copies_off_step(vllm_config)
        """Captures' blocks are copied by the writer, not on the step (vLLM's CPU build, where a
        copy is a real memory copy); vLLM then holds a request's blocks until they are."""
        self.held = HeldBlocks()
        self._unheld: set[str] = set()
        self._workers = max(1, int(getattr(vllm_config.parallel_config, "world_size", 1)))
        """Workers reporting copies (each copies its own piece of every capture)."""
        self.captures = CaptureWriter(lambda copied: self._file(copied), self.faults, copied=self.held.copied)
        """The worker side's background writer: captures are filed off the step."""
        self._filed: set[Filed] = set()
        self._filed_lock = threading.Lock()
        self.clock = PrefillClock(self.store.deadlines)
        """The worker side's forwards, timed: the store's deadlines scale with their time per token."""

    # -- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        try:
            return self._matched(request, num_computed_tokens)
        except Exception as exc:  # any fault: offer nothing, vLLM computes the request itself
            self.faults.caught("get_num_new_matched_tokens", exc)
            track = self._requests.get(request.request_id)
            if track is not None:
                track.plan = None
            return 0, False

    def _matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        track = self._track(request)
        if not track.servable or track.load_failed:  # a failed load: vLLM computes it at once
            return 0, False
        limit = track.prompt_len - 1  # the last prompt token is always computed (its logits)
        # vLLM's prefix cache hashes loaded blocks as computed ones: approximations only under a salt
        chunks, salted = track.chunks, track.salted
        plan = self.synthesis.plan(
            track.namespace, chunks, num_computed_tokens, limit, self.block_size, approximate=salted
        )
        if plan.refused and track.plan is None:  # counted once per request (vLLM may ask again)
            self.stats.kept_refused += 1
        track.plan = plan
        return plan.tokens, plan.tokens > 0  # loaded asynchronously, off the step (`loads`)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        try:
            self._allocated(request, blocks, num_external_tokens)
        except Exception as exc:  # the offered blocks cannot be filled: report them failed
            self.faults.caught("update_state_after_alloc", exc)
            failed = self._requests.get(request.request_id)
            if failed is not None:  # never offered again: vLLM's recompute would meet the same fault
                failed.servable = False
            if num_external_tokens <= 0:  # nothing offered: nothing for vLLM to wait for
                return
            try:
                # the offer began past vLLM's own hit (vLLM sets the request's count only later)
                track = self._requests.get(request.request_id)
                plan = track.plan if track is not None else None
                start = plan.device_len if plan is not None else int(request.num_computed_tokens)
                ids = list(blocks.get_block_ids()[0])
                bs = self.block_size
                slots = tuple(ids[t // bs] * bs + t % bs for t in range(start, start + num_external_tokens))
                self._loads.append(Load(request.request_id, None, 0, 0, start, slots))
            except Exception as again:
                self.faults.caught("update_state_after_alloc.report", again)

    def _allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        track = self._requests.get(request.request_id)
        if track is None or track.plan is None:  # vLLM waits for this load: it must be reported
            raise KeyError(f"{num_external_tokens} tokens allocated for a request kamera offered nothing")
        plan = track.plan
        if plan.tokens != num_external_tokens:  # vLLM allocated less: plan to exactly that
            end = plan.device_len + num_external_tokens
            plan = self.synthesis.plan(
                track.namespace, track.chunks, plan.device_len, end, self.block_size, approximate=track.salted
            )
        track.block_ids = list(blocks.get_block_ids()[0])
        loads: dict[LoadId, EntryKey] = {}
        for item in plan.served:
            start = max(item.chunk.start, plan.device_len)
            end = min(item.chunk.end, plan.end)
            slots = self._slots(track, start, end)
            a, b = start - item.chunk.start, end - item.chunk.start
            rows = _rows(track.positions, start, end)
            self._loads.append(Load(request.request_id, item.entry, a, b, start, slots, rows))
            loads[(request.request_id, start)] = item.entry
        # recorded once the worker side reports every load written (`update_connector_output`)
        self._offered[request.request_id] = _Offered(track.namespace, track.chunks, plan, loads)
        track.plan = plan
        self.stats.offered += 1
        self.stats.tokens_offered += plan.tokens
        self.stats.tokens_kept += plan.kept_tokens

    def build_connector_meta(self, scheduler_output: Any) -> KameraMetadata:
        meta = KameraMetadata(loads=self._loads)
        self._loads = []
        try:
            self._plan_saves(meta, scheduler_output)
        except Exception as exc:  # captures skipped this step: later forwards pay, nothing else
            self.faults.caught("build_connector_meta", exc)
            meta.saves = []
            self._disown(scheduler_output)
        for save in meta.saves:  # exactly the requests whose captures the workers queue
            self._requests[save.req_id].copies += 1
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        meta.unheld, self._unheld = self._unheld, set()
        tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        meta.idle, meta.tokens = tokens == 0, int(tokens or 0)
        return meta

    def _disown(self, scheduler_output: Any) -> None:
        """After a fault mid-step, the step's requests' block lists may be stale: capturing from
        them would store other tokens' KV under these chunks' states. Such requests are neither
        captured nor served from here on (vLLM runs them as it would without kamera)."""
        try:
            req_ids = [new.req_id for new in scheduler_output.scheduled_new_reqs]
            req_ids += list(scheduler_output.scheduled_cached_reqs.req_ids)
        except Exception:
            req_ids = list(self._requests)
        for req_id in req_ids:
            track = self._requests.get(req_id)
            if track is not None:
                track.servable = False

    def _plan_saves(self, meta: KameraMetadata, scheduler_output: Any) -> None:
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            track = self._requests.get(new.req_id)
            if track is not None:
                track.block_ids = list(new.block_ids[0])
                meta.saves += self._saves(new.req_id, track, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            track = self._requests.get(req_id)
            if track is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: its blocks were freed, its KV is recomputed
                track.block_ids, track.saved, track.walked = [], set(), 0
            if new_ids is not None:
                track.block_ids += list(new_ids[0])
            meta.saves += self._saves(req_id, track, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' report of a step (`KameraWorkerMeta`): an offer whose loads were all
        written is recorded as loaded; one with a failed load is dropped, never recorded, its
        request not offered again and the entries that failed not offered to any until filed
        anew (`PrefixSynthesis.failed`)."""
        try:
            report = getattr(connector_output, "kv_connector_worker_meta", None)
            if not isinstance(report, KameraWorkerMeta):
                return
            filed = [EntryKey(*entry) for entry in report.filed]  # type: ignore[arg-type]
            self.splits.filed(filed)
            self.synthesis.failed.refiled({unsharded(entry) for entry in filed})
            for req_id, n in report.copies.items():
                track = self._requests.get(req_id)
                if track is not None:
                    track.copied += n
            for req_id, offer in list(self._offered.items()):
                self._settle(req_id, offer, report)
        except Exception as exc:  # a load not recorded: a later request recomputes, no more
            self.faults.caught("update_connector_output", exc)

    def _settle(self, req_id: str, offer: _Offered, report: KameraWorkerMeta) -> None:
        """An offer whose loads the workers reported: failed (some) or written (all)."""
        failed = offer.loads.keys() & report.failed
        if failed:
            del self._offered[req_id]
            self.synthesis.failed.failed(offer.loads[load] for load in failed)
            track = self._requests.get(req_id)
            if track is not None:
                track.load_failed = True
        elif offer.loads.keys() <= report.written:
            del self._offered[req_id]
            self.synthesis.failed.loaded(offer.loads.values())
            self.synthesis.loaded(offer.namespace, offer.chunks, offer.plan)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request, and report what kamera served it (`served_report`: vLLM returns
        it as the request's ``kv_transfer_params``). Where workers copy captures off the step
        and one was planned for it, its blocks are freed later, once every worker reports them
        copied (``get_finished``), unless the workers already reported every copy made: then
        now, and the workers are told (`KameraMetadata.unheld`). Both sides decide from the same
        step metadata, as vLLM's contract needs (a request reported freed must be one held)."""
        track = self._requests.get(request.request_id)
        report = served_report(track.plan, track.load_failed) if track is not None else None
        later = self.copies_off_step and track is not None and track.copies > 0
        if later and track is not None and track.copied >= track.copies * self._workers:
            later = False
            self._unheld.add(request.request_id)
        try:
            self._forget(request.request_id)
        except Exception as exc:
            self.faults.caught("request_finished", exc)
        return later, report

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` where vLLM's hybrid manager is on (`SupportsHMA`): kamera's blocks
        are the first group's, the only one where it serves (`one_group`)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._offered.pop(req_id, None)  # finished before its loads were reported: never recorded

    def _track(self, request: Any) -> _Track:
        track = self._requests.get(request.request_id)
        if track is None:
            tokens = list(request.prompt_token_ids or [])
            features = list(getattr(request, "mm_features", None) or [])
            lora = getattr(getattr(request, "lora_request", None), "lora_name", "") or ""
            salt = getattr(request, "cache_salt", None) or ""
            namespace = f"{lora}|{salt}" if lora or salt else ""  # "": a window's chunks' namespace
            # images only; on M-RoPE each with the data vLLM computes its positions from
            mrope = self.mrope if features else None
            servable = self.one_group and images_only(features, with_data=mrope is not None)
            track = _Track(namespace, [], len(tokens), False, bool(salt))
            self._requests[request.request_id] = track  # a fault below leaves it unserved
            images = self.images.spans(features) if servable else []
            track.chunks = request_chunks(tokens, images, self.rules, namespace)
            if servable and mrope is not None:
                track.positions = mrope.of(tokens, features)
            track.servable = servable
        return track

    def _saves(self, req_id: str, track: _Track, upto: int) -> list[Save]:
        if not track.servable:
            return []
        upto = min(upto, track.prompt_len)
        if upto <= track.walked:
            return []
        track.walked = upto
        out = []
        found = self.synthesis.captures(track.namespace, track.chunks, upto)
        for chunk, _, entry in found:
            if chunk.start not in track.saved:  # a chunk is captured once per request
                track.saved.add(chunk.start)
                first, last = chunk.start // self.block_size, (chunk.end - 1) // self.block_size
                blocks = tuple(track.block_ids[first : last + 1])
                offset = chunk.start - first * self.block_size
                rows = _rows(track.positions, chunk.start, chunk.end)
                out.append(
                    Save(req_id, entry, chunk.start, chunk.end, blocks=blocks, offset=offset, positions=rows)
                )
        return out

    def _slots(self, track: _Track, start: int, end: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(track.block_ids[t // bs] * bs + t % bs for t in range(start, end))

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map the caches to the model's layers by name and choose each one's layout from the
        attention backend vLLM runs it with; this rank's place in the grid decides which piece of
        each entry it reads and writes. Anything the connector cannot address fails here
        (`BlockLayoutError`), before the first step."""
        from vllm.model_executor.models.utils import extract_layer_index

        tp_rank, stage = _ranks()
        heads = self.grid.head_range(tp_rank)
        backends = _backend_names(self._vllm_config, list(kv_caches))
        placed, self.skipped_layers = place_layers(
            kv_caches, backends, self.layout, heads[1] - heads[0], extract_layer_index
        )
        if self.skipped_layers:
            _LOG.warning(
                "kamera: %d KV cache layers are no layer of the model and are skipped by name "
                "(draft or unknown layers: %s)",
                len(self.skipped_layers),
                ", ".join(self.skipped_layers[:4]) + (" ..." if len(self.skipped_layers) > 4 else ""),
            )
        self._pool = VLLMSlots(placed, self.layout)
        if (self._pool.first, self._pool.end) != self.grid.stages[stage]:
            raise BlockLayoutError(
                f"pipeline stage {stage} registered KV caches of layers {self._pool.first}.."
                f"{self._pool.end - 1}, but vLLM's partition gives it {self.grid.stages[stage]}; "
                "kamera's entries need every layer of the stage"
            )
        # no `Splits` memory here: the scheduler side found the entry, this side must find it too
        self.synthesis.store = ShardedStore(self.store, self.grid, tp_rank, stage)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """vLLM hands the worker this step's metadata before the forward runs: the forward's
        clock starts (`PrefillClock`)."""
        super().bind_connector_metadata(connector_metadata)
        try:
            caches = self._pool.caches
            self.clock.began(caches[0].device if caches else None)
        except Exception as exc:  # an unmeasured step: the deadlines keep their last estimate
            self.faults.caught("bind_connector_metadata", exc)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Hand this step's loads to the background thread (`loads`): vLLM calls this after the
        step's forward is launched (no load feeds it) and schedules each request once
        `get_finished` names it."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KameraMetadata)
        self.loads.submit(meta.loads)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The ended requests whose captured blocks are copied (vLLM frees them now) and the
        requests whose loads are done. Their written and failed loads and the blocks a failure
        left unwritten are reported in this same step (`build_connector_worker_meta`,
        `get_block_ids_with_load_errors`, which vLLM calls after this), as its contract asks.

        In a step with nothing scheduled the background threads are waited for (at most
        `IDLE_WAIT` seconds): returning at once, vLLM's loop steps again and again, and that
        Python thread holding the interpreter starved the loader (requests parked for their
        loads took 0.2-1 s where vLLM alone took 0.1 s)."""
        meta = self._connector_metadata if self.has_connector_metadata() else None
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

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before this step's forward reuses preempted requests' blocks: their queued copies are
        made now, on the step (rare: what a preemption costs)."""
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if preempted and self.copies_off_step:
            self.captures.copy_now(preempted)

    def _load(self, load: Load) -> bool:
        """On the loader's thread: one load into vLLM's blocks (``False``: not written; an entry
        gone or unreadable is a fault of its own kind, counted)."""
        if load.entry is None:
            return False
        kv = self.synthesis.read(load.entry)
        if kv is None or kv.num_tokens < load.b:
            kind = "UnreadableEntry" if self.synthesis.store.contains(load.entry) else "LostEntry"
            self.faults.count("start_load_kv", kind, f"request {load.req_id}: {load.entry} could not be read")
            return False
        a, b = load.a, load.b
        part = ChunkKV(kv.keys[:, :, a:b], kv.values[:, :, a:b], None, kv.chunk_key)
        positions = load.positions
        if positions is None:
            positions = request_positions(self.layout, load.start, load.start + b - a)
        self._pool.write(part, positions, torch.tensor(load.slots, dtype=torch.long))
        self.stats.loads += 1
        self.stats.chunks_loaded += 1
        self.stats.tokens_loaded += b - a
        self.recent_loads.append(load)
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a loaded request runs only after its loads are reported done."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Captures read every layer at once after the forward (``wait_for_save``)."""

    def wait_for_save(self) -> None:
        """Copy the blocks of each captured chunk out of vLLM's caches in the cache's dtype and
        queue them for the background writer (`kamera_agent.engines.vllm.captures`): no store
        I/O, no device sync."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KameraMetadata)
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
        positions = copied.positions
        if positions is None:
            positions = request_positions(self.layout, copied.start, copied.end)
        keys, values = self._pool.unpack(copied.blocks, copied.rows)
        kv = ChunkKV(keys.float(), values.float(), positions, copied.entry.key)
        self.synthesis.write(copied.entry, to_position_free(kv, self.layout))
        store = self.synthesis.store
        filed = store.filed_as(copied.entry) if isinstance(store, ShardedStore) else copied.entry
        self.stats.chunks_captured += 1
        if filed is not None:
            with self._filed_lock:
                self._filed.add((filed.kind, filed.key, filed.variant))

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
            self.store.flush()
        except Exception as exc:  # shutdown goes on; the captures left are later forwards' cost
            self.faults.caught("shutdown", exc)

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

    # -- metrics (both sides) ---------------------------------------------------------------
    def get_kv_connector_stats(self) -> KameraConnectorStats | None:
        """What this side counted since its last report (`kamera_agent.engines.vllm.metrics`):
        vLLM sums the workers', adds the scheduler's and exports them on ``/metrics``."""
        try:
            return self._reports.since(self.stats, self.faults.as_dict())
        except Exception as exc:  # a report missed: the counters lag, nothing else
            self.faults.caught("get_kv_connector_stats", exc)
            return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KameraConnectorStats:
        return KameraConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KameraPromMetrics:
        return KameraPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _rows(positions: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """Tokens ``start..end``'s M-RoPE positions (their own copy: it crosses to the worker side)."""
    return None if positions is None else positions[:, start:end].clone()


def _copies_off_step(vllm_config: Any) -> bool:
    """Whether captures' blocks are copied by the writer (the CPU build: a copy there is a memory
    copy on the step; on CUDA the step only launches an asynchronous one). Both sides decide the
    same from the same config."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
    return str(device) == "cpu"


def _backend_names(vllm_config: Any, names: list[str]) -> dict[str, str]:
    """Each layer's attention backend (``get_name()``) as vLLM built it; where vLLM has no layer
    objects (a harness without a model), the backend its selector picks for this model."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, names)  # type: ignore[type-abstract]
    fallback = None if len(layers) == len(names) else get_current_attn_backends(vllm_config)[0].get_name()
    return {n: layers[n].get_attn_backend().get_name() if n in layers else str(fallback) for n in names}


def _grid(layout: KVLayout, vllm_config: Any) -> Grid:
    """The engine's split: KV heads over tensor-parallel ranks, layers over pipeline stages
    (vLLM's own partition, ``VLLM_PP_LAYER_PARTITION`` included)."""
    from vllm.distributed.utils import get_pp_indices

    parallel = vllm_config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    stages = [get_pp_indices(layout.num_layers, rank, pp) for rank in range(pp)]
    return Grid.of(layout, 1 if layout.kind == "mla" else tp, stages)


def _ranks() -> tuple[int, int]:
    """This worker's tensor-parallel rank and pipeline stage (``(0, 0)`` outside vLLM's groups)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 0
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pp_group().rank_in_group
