"""`ConnectorScheduler`: the scheduler half of kamera's vLLM connector (it plans; it moves no KV).

vLLM's connector contract is prefix-shaped: the scheduler asks how many tokens after vLLM's own
cached prefix the connector can load (``get_num_new_matched_tokens``), allocates blocks for them
(``update_state_after_alloc``) and sends the workers one message per step
(``build_connector_meta``). Here the loadable tokens are the longest run of the request's chunks
(messages, images by ``mm_features``: `kamera_agent.engines.vllm.images`) whose states the store
holds (`EngineRequest.plan`, the planning SGLang's plugin uses too); each step's message carries
the loads of the blocks vLLM gave them and the captures of every prompt chunk the step's forward
computes. The workers' reports (``update_connector_output``) settle each offer: all its loads
written (recorded as loaded), or some failed (the request not offered again, the entries offered
to no request until filed anew: `kamera_agent.engines.offers`).

Every hook catches at its boundary (`HookFaults`): a fault costs its request the reuse (nothing
offered; blocks offered reported as load failures, which vLLM computes), never the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kamera_agent.engines.chunking import ChunkRules, request_chunks
from kamera_agent.engines.lifecycle import (
    EngineRequest,
    ServedReport,
    count_offer,
    load_spans,
    namespace_of,
)
from kamera_agent.engines.load_plan import LoadPlan, RequestChunk
from kamera_agent.engines.shards import ShardedStore, Splits, unsharded
from kamera_agent.engines.vllm.common import LOG, ConnectorSide, KameraMetadata, KameraWorkerMeta, Save
from kamera_agent.engines.vllm.images import ImageIdentities, images_only
from kamera_agent.engines.vllm.loads import Load, LoadId
from kamera_agent.engines.vllm.mrope import MRopePositions
from kamera_agent.store import EntryKey

__all__ = ["ConnectorScheduler", "served_report"]


@dataclass(frozen=True)
class _Offered:
    """A load plan the scheduler side offered, recorded (`EngineRequest.loaded`) only once the
    worker side reports every one of its loads written: under ``"keep"`` a recorded load names
    the state later requests find in vLLM's prefix, which a failed load never left there."""

    request: EngineRequest
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

    @property
    def request(self) -> EngineRequest:
        """The request as kamera plans it (the engine-neutral lifecycle's view)."""
        return EngineRequest(self.namespace, self.chunks, self.salted)


def served_report(plan: LoadPlan | None, failed: bool = False) -> dict[str, Any]:
    """What kamera served one request, under ``"kamera"`` (vLLM's ``kv_transfer_params`` of its
    output; ``vllm serve`` returns it in the response body): `ServedReport`'s fields."""
    return {"kamera": ServedReport.of(plan, failed).as_dict()}


class ConnectorScheduler(ConnectorSide):
    """The connector's hooks in vLLM's scheduler process: plan loads, send loads and captures to
    the workers, settle offers from their reports, report each request at its end.

    A model whose KV vLLM splits into several groups (sliding-window layers beside full ones,
    state layers) is served nothing (`ConnectorSide.one_group`): kamera's entries are every
    layer's KV of a chunk in one group's blocks.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, kv_cache_config)
        from transformers import AutoTokenizer

        if not self.one_group:
            LOG.warning(
                "kamera: this model's KV is split into %d cache groups (hybrid attention); the "
                "connector serves and captures nothing, vLLM runs as without it",
                len(kv_cache_config.kv_cache_groups),
            )
        self.splits = Splits()
        """The scheduler side's memory: the grids found holding pieces, the entries workers filed."""
        self.synthesis.store = ShardedStore(self.store, self.grid, splits=self.splits)
        model = vllm_config.model_config
        tokenizer = AutoTokenizer.from_pretrained(model.tokenizer) if model.tokenizer else None
        self.rules = ChunkRules.for_model(model.hf_config, tokenizer)
        self.images = ImageIdentities()
        self.mrope = MRopePositions.of_model(model) if self.layout.rope.axes is not None else None
        """vLLM's M-RoPE positions of a request with images (``None``: 1-D RoPE, positions are indices)."""
        self._requests: dict[str, _Track] = {}
        self._loads: list[Load] = []
        self._offered: dict[str, _Offered] = {}
        self._unheld: set[str] = set()
        self._workers = max(1, int(getattr(vllm_config.parallel_config, "world_size", 1)))
        """Workers reporting copies (each copies its own piece of every capture)."""

    # -- a request arrives: what can be loaded past vLLM's own hit ---------------------------
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
        plan = track.request.plan(self.synthesis, num_computed_tokens, limit, self.block_size)
        if plan.refused and track.plan is None:  # counted once per request (vLLM may ask again)
            self.stats.kept_refused += 1
        track.plan = plan
        return plan.tokens, plan.tokens > 0  # loaded asynchronously, off the step (the workers)

    # -- vLLM gave the offered tokens blocks: the loads -------------------------------------
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        try:
            self._allocated(request, blocks, num_external_tokens)
        except Exception as exc:  # the offered blocks cannot be filled: report them failed
            self.faults.caught("update_state_after_alloc", exc)
            failed = self._requests.get(request.request_id)
            if failed is not None:  # never offered again: vLLM's recompute would meet the same fault
                failed.servable = False
            if num_external_tokens > 0:  # offered: vLLM waits for its loads, so report them failed
                self._unfilled(request, blocks, num_external_tokens)

    def _unfilled(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Blocks offered that no load fills: sent as one load of no entry, which the workers
        report failed (vLLM computes them under its load-failure policy)."""
        try:
            # the offer began past vLLM's own hit (vLLM sets the request's count only later)
            track = self._requests.get(request.request_id)
            plan = track.plan if track is not None else None
            start = plan.device_len if plan is not None else int(request.num_computed_tokens)
            ids = list(blocks.get_block_ids()[0])
            slots = _slots(ids, self.block_size, start, start + num_external_tokens)
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
            plan = track.request.plan(self.synthesis, plan.device_len, end, self.block_size)
        track.block_ids = list(blocks.get_block_ids()[0])
        loads: dict[LoadId, EntryKey] = {}
        for span in load_spans(plan):
            slots = _slots(track.block_ids, self.block_size, span.start, span.end)
            rows = _rows(track.positions, span.start, span.end)
            entry = span.served.entry
            self._loads.append(
                Load(request.request_id, entry, span.entry_from, span.entry_to, span.start, slots, rows)
            )
            loads[(request.request_id, span.start)] = entry
        # recorded once the worker side reports every load written (`update_connector_output`)
        self._offered[request.request_id] = _Offered(track.request, plan, loads)
        track.plan = plan
        count_offer(self.stats, plan)

    # -- each step: what the workers load and capture ---------------------------------------
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

    def _saves(self, req_id: str, track: _Track, upto: int) -> list[Save]:
        if not track.servable:
            return []
        upto = min(upto, track.prompt_len)
        if upto <= track.walked:
            return []
        track.walked = upto
        out = []
        for chunk, _, entry in track.request.captures(self.synthesis, upto):
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

    # -- the workers' report of a step ------------------------------------------------------
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
            offer.request.loaded(self.synthesis, offer.plan)

    # -- a request ends ---------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request, and report what kamera served it (`served_report`: vLLM returns
        it as the request's ``kv_transfer_params``). Where workers copy captures off the step
        and one was planned for it, its blocks are freed later, once every worker reports them
        copied (the workers' ``get_finished``), unless the workers already reported every copy
        made: then now, and the workers are told (`KameraMetadata.unheld`). Both sides decide
        from the same step metadata, as vLLM's contract needs (a request reported freed must be
        one held)."""
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
        """`request_finished` where vLLM's hybrid manager is on (``SupportsHMA``): kamera's
        blocks are the first group's, the only one where it serves (`one_group`)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._offered.pop(req_id, None)  # finished before its loads were reported: never recorded

    # -- a request's view -------------------------------------------------------------------
    def _track(self, request: Any) -> _Track:
        track = self._requests.get(request.request_id)
        if track is None:
            tokens = list(request.prompt_token_ids or [])
            features = list(getattr(request, "mm_features", None) or [])
            lora = getattr(getattr(request, "lora_request", None), "lora_name", "") or ""
            salt = getattr(request, "cache_salt", None) or ""
            namespace = namespace_of(lora, salt)
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


def _rows(positions: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """Tokens ``start..end``'s M-RoPE positions (their own copy: it crosses to the worker side)."""
    return None if positions is None else positions[:, start:end].clone()


def _slots(block_ids: list[int], block_size: int, start: int, end: int) -> tuple[int, ...]:
    """vLLM's slots of request tokens ``start..end`` in the request's blocks ``block_ids``."""
    return tuple(block_ids[t // block_size] * block_size + t % block_size for t in range(start, end))
