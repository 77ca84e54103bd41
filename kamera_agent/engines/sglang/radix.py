"""`KameraRadixCache`: SGLang's radix cache, extended past its prefix by relocated chunk KV.

SGLang's contract for a cache with a second tier is two-phase: ``match_prefix`` reports, after
the device prefix, ``host_hit_length`` tokens that can be loaded (called again and again for a
waiting request, so it must change nothing), ``PrefillAdder`` budgets them, and
``init_load_back`` allocates slots and fills them, all or nothing, returning the new match
node. Here the second tier is kamera's store: the request is cut into chunks (`request_chunks`),
each chunk's state is chained over the chunks before it (`PrefixSynthesis`), and the longest run
whose states the store holds is loaded: each chunk's position-free KV rotated to SGLang's
positions for this request (1-D, or the request's precomputed M-RoPE positions) and written into
new slots, which then join the tree under the request's tokens, so SGLang owns, locks and evicts
them like any prefix. ``checkpoint`` (SGLang publishing a prefill) captures the chunks' KV first.
A load in a state a forward would not compute is remembered with the tree slots it fills
(`KeptSlots`); when SGLang evicts those slots (``_delete_leaf``) or resets the tree, the memory
is cut to what remains, so tokens computed again are known for what a forward gives.

Every hook catches kamera's faults at its boundary (`HookFaults`): a fault costs the request the
reuse (SGLang's own match, no load, a capture skipped), never the request, a slot or the tree.

The plugin's factory always gives it a store (memory, plus disk or a shared Valkey/Redis tier
where the settings name one); built without a store or layout it is SGLang's own radix cache.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from kamera_agent.config import WindowConfig
from kamera_agent.engines.faults import HookFaults
from kamera_agent.engines.lifecycle import (
    EngineRequest,
    ServedReport,
    count_offer,
    count_unloadable,
    count_written,
    load_spans,
    namespace_of,
)
from kamera_agent.engines.load_plan import EngineStats, Loaded, LoadPlan, RequestChunk
from kamera_agent.engines.prefill_clock import MIN_TOKENS
from kamera_agent.engines.sglang.kept_slots import KeptSlots
from kamera_agent.engines.sglang.metrics import CacheExport
from kamera_agent.engines.sglang.pool import SGLangSlots
from kamera_agent.engines.sglang.segments import ChunkRules, request_chunks
from kamera_agent.engines.slots import request_positions
from kamera_agent.engines.synthesis import PrefixSynthesis, serving
from kamera_agent.operator.layout import ChunkKV, KVLayout
from kamera_agent.operator.rope import Pairing
from kamera_agent.store import ChunkStore

__all__ = ["KameraRadixCache"]

_LOG = logging.getLogger(__name__)
_CUT_REQUESTS = 4096  # requests whose chunks are kept (released ones are dropped at once)


class KameraRadixCache(RadixCache):  # type: ignore[misc]
    """SGLang's radix cache whose match extends over chunks kamera's store can serve.

    Args:
        params: SGLang's ``CacheInitParams`` (pools, allocator, page size).
        config: which approximations may be served (`serving`: exact unless survivors keep, kept
            states within the drift budget).
        store: the chunk store (shared by every worker that names one URL); ``None``: SGLang's
            own radix reuse only.
        layout: the model's KV layout (where the rope band sits, its frequencies).
        rules: how requests are cut into chunks (`ChunkRules.for_model`).
        pool_pairing: how SGLang's rotary pairs the rope band (`rotary_pairing`); ``None``: as
            the layout does.
    """

    def __init__(
        self,
        params: Any,
        config: WindowConfig | None = None,
        *,
        store: ChunkStore | None = None,
        layout: KVLayout | None = None,
        rules: ChunkRules | None = None,
        pool_pairing: Pairing | None = None,
    ) -> None:
        self.synthesis: PrefixSynthesis | None = None
        self.kept_slots = KeptSlots()
        """The tree's slots that hold kept loads (what an eviction tells `PrefixSynthesis.lost`)."""
        super().__init__(params)  # calls reset()
        self.config = config or WindowConfig.exact()
        self.layout, self.rules, self.pool_pairing = layout, rules or ChunkRules(), pool_pairing
        if store is not None and layout is not None and not self.is_eagle:
            mode, budget = serving(self.config, store, store.fingerprint)
            self.synthesis = PrefixSynthesis(store, mode, budget)
        self.stats = EngineStats()
        self.faults = HookFaults(_LOG)
        """Runtime faults caught at this cache's hooks (``hook:ExceptionType`` -> count)."""
        self._cut: OrderedDict[str, tuple[int, list[RequestChunk]]] = OrderedDict()
        self.deadlines = None if store is None else store.deadlines
        """The store's deadlines, told each request's first prefill time per token (timed from
        its admission's match to its first publish: `kamera_agent.store.deadlines`)."""
        self._admitted: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self.export = self._export(params, store)
        """kamera's series on SGLang's ``/metrics`` (``--enable-metrics``), else ``None``."""

    def _export(self, params: Any, store: ChunkStore | None) -> CacheExport | None:
        """SGLang exports metrics: kamera's go beside its radix-cache series, under their labels."""
        if store is None or not getattr(params, "enable_metrics", False):
            return None
        try:
            return CacheExport(store, dict(getattr(self.metrics_collector, "labels", None) or {}))
        except Exception as exc:  # no series, as without --enable-metrics: the cache serves on
            self.faults.caught("metrics", exc)
            return None

    @property
    def kv_pool(self) -> Any:
        return self.token_to_kv_pool_allocator.get_kvcache()

    # -- SGLang's two phases ----------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> Any:
        result = super().match_prefix(params)
        if self.synthesis is None or self.disable or params.req is None:
            return result  # SGLang's own matches (a checkpoint re-finding its node) need no plan
        try:
            plan = self._plan(params.key, params.req, result.device_prefix_len)
        except Exception as exc:  # SGLang's own match, as if kamera were not there
            self.faults.caught("match_prefix", exc)
            return result
        self.stats.kept_refused += int(plan.refused)
        if plan.refused and plan.tokens == 0:  # no load follows: the refusal is the request's report
            _report(params.req, plan)
        self._matched(params.req.rid, plan.end)
        return result if plan.tokens == 0 else result._replace(host_hit_length=plan.tokens)

    def _matched(self, rid: str, prefix: int) -> None:
        """The request may be admitted now, its prefill to start past ``prefix`` (the last match
        before its first publish is its admission's)."""
        self._admitted[rid] = (time.perf_counter(), prefix)
        self._admitted.move_to_end(rid)
        while len(self._admitted) > _CUT_REQUESTS:
            self._admitted.popitem(last=False)

    def init_load_back(self, params: Any) -> tuple[int, Any]:
        """Write the planned chunks into new slots and add them to the tree: all or nothing."""
        req, node = params.req, params.best_match_node
        if self.synthesis is None or req is None or params.host_hit_length <= 0:
            return 0, node
        slots = None
        try:
            key = _request_key(req)
            device = self.path_device_indices(node)[: req.prefix_len].to(torch.int64)
            plan = self._plan(key, req, len(device), limit=len(device) + params.host_hit_length)
            if plan.tokens != params.host_hit_length:  # the store changed since the match
                self.stats.failed += 1
                return 0, node
            loaded = self.synthesis.load(plan)
            if not loaded.ok:  # gone or unreadable: counted, not offered again until filed anew
                self._lost(req, loaded)
                return 0, node
            slots = self._alloc(plan.tokens)
            if slots is None:
                self.stats.failed += 1
                return 0, node
            self._write(req, plan, list(loaded.kvs), slots)
        except Exception as exc:  # never fail SGLang's admission over a cache: decline the load
            self.faults.caught("init_load_back", exc)
            if slots is not None:
                self.token_to_kv_pool_allocator.free(slots)
            self.stats.failed += 1
            return 0, node
        full = RadixKey(key.token_ids[: plan.end], req.extra_key, cache_salt=req.cache_salt)
        value = torch.cat([device, slots])
        done = self.insert(InsertParams(key=full, value=value, priority=req.priority or 0))
        if done.prefix_len > plan.device_len:  # the tree grew meanwhile: those slots are duplicates
            self.token_to_kv_pool_allocator.free(slots[: done.prefix_len - plan.device_len])
        match = super().match_prefix(MatchPrefixParams(key=full))
        assert match.device_prefix_len == plan.end, (match.device_prefix_len, plan.end)
        try:  # the load is in the tree now; only kamera's own bookkeeping may fail past here
            self._loaded(key, req, plan, self.path_device_indices(match.last_device_node))
        except Exception as exc:
            self.faults.caught("init_load_back.loaded", exc)
        count_offer(self.stats, plan)
        count_written(self.stats, plan.tokens, len(plan.served))
        _report(req, plan)
        return plan.tokens, match.last_device_node

    def _lost(self, req: Any, loaded: Loaded) -> None:
        """A load that found offered entries gone or unreadable: a fault of its own kind each,
        counted and logged (once per kind) like any caught at a hook; SGLang computes the tokens."""
        assert self.synthesis is not None
        self.stats.failed += 1
        count_unloadable(self.faults, self.synthesis.store, "init_load_back", req.rid, loaded.failed)

    def checkpoint(self, req: Any, *, up_to: int) -> None:
        """Capture the chunks' KV from the request's slots, then publish them as SGLang does."""
        if self.synthesis is not None and not self.disable:
            try:
                self._timed(req.rid, up_to)
                self._capture(req, up_to)
            except Exception as exc:  # a capture missed costs a later forward, no more
                self.faults.caught("checkpoint", exc)
        super().checkpoint(req, up_to=up_to)

    def _timed(self, rid: str, up_to: int) -> None:
        """The request's first publish: its prefill since admission, per token, for the deadlines."""
        admitted = self._admitted.pop(rid, None)
        if admitted is not None and self.deadlines is not None and up_to - admitted[1] >= MIN_TOKENS:
            self.deadlines.observe(up_to - admitted[1], time.perf_counter() - admitted[0])

    def _delete_leaf(self, node: Any) -> None:
        """SGLang evicts ``node`` (its slots are being freed): loads that held them lose those tokens."""
        if self.synthesis is not None and len(self.kept_slots):
            try:
                for prefix, kept_tokens in self.kept_slots.evicted(node.value.tolist()).items():
                    self.synthesis.lost(prefix, kept_tokens)
            except Exception as exc:
                self.faults.caught("evict", exc)
        super()._delete_leaf(node)

    def reset(self) -> None:
        """SGLang empties the tree (every slot freed): every load is gone."""
        super().reset()
        for prefix in self.kept_slots.clear():
            if self.synthesis is not None:
                self.synthesis.lost(prefix, 0)

    # -- kamera's side ----------------------------------------------------------------------
    def _plan(self, key: Any, req: Any | None, device_len: int, limit: int | None = None) -> LoadPlan:
        """What the store can serve after ``device_len`` within ``limit`` tokens (the match's key
        length: SGLang never matches a prompt's last token)."""
        assert self.synthesis is not None
        end = len(key) if limit is None else limit
        # a load enters SGLang's tree under the request's tokens: `EngineRequest.plan` says why
        # approximations are served only under the client's salt
        return self._request(key, req).plan(self.synthesis, device_len, end, self.page_size)

    def _request(self, key: Any, req: Any | None) -> EngineRequest:
        """The request as kamera plans it: its namespace, chunks and salt (SGLang's tree key)."""
        return EngineRequest(_namespace(key), self._chunks(key, req), bool(key.cache_salt))

    def _loaded(self, key: Any, req: Any, plan: LoadPlan, path: torch.Tensor) -> None:
        """Remember the loads ``plan`` made that a forward would not compute, with the slots of
        ``path`` (the tree's slots of ``tokens[:plan.end]``) that hold them."""
        assert self.synthesis is not None
        for load in self._request(key, req).loaded(self.synthesis, plan):
            start = load.chunk.start
            self.kept_slots.record(load.prefix, path[start : start + load.tokens].tolist())

    def _chunks(self, key: Any, req: Any | None) -> list[RequestChunk]:
        """The request's chunks, cut once per request: SGLang matches a waiting request on every
        scheduling pass, and cutting hashes every prompt token."""
        if req is None:
            return request_chunks(list(key.raw_token_ids()), self.rules, _namespace(key))
        known = self._cut.get(req.rid)
        if known is None or known[0] != len(req.origin_input_ids):
            known = (
                len(req.origin_input_ids),
                request_chunks(list(req.origin_input_ids), self.rules, _namespace(key)),
            )
            self._cut[req.rid] = known
            while len(self._cut) > _CUT_REQUESTS:
                self._cut.popitem(last=False)
        return known[1]

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        """SGLang released the request: its chunks need not be kept."""
        super().on_release(req, checkpointed=checkpointed)
        try:
            self._cut.pop(req.rid, None)
            self._admitted.pop(req.rid, None)
            if self.export is not None:
                self.export.publish(self.stats, self.faults.as_dict())
        except Exception as exc:
            self.faults.caught("on_release", exc)

    def _alloc(self, tokens: int) -> torch.Tensor | None:
        allocator = self.token_to_kv_pool_allocator
        if allocator.available_size() < tokens:
            self.evict(EvictParams(num_tokens=tokens - allocator.available_size()))
        slots = allocator.alloc(tokens)
        return None if slots is None else slots.to(torch.int64)

    def _slots(self) -> SGLangSlots:
        assert self.layout is not None
        return SGLangSlots(self.kv_pool, self.layout, pool_pairing=self.pool_pairing)

    def _write(self, req: Any, plan: LoadPlan, kvs: list[ChunkKV], slots: torch.Tensor) -> None:
        pool = self._slots()
        for span, kv in zip(load_spans(plan), kvs, strict=True):
            a, b = span.entry_from, span.entry_to
            part = replace(kv, keys=kv.keys[:, :, a:b], values=kv.values[:, :, a:b])
            where = slots[span.start - plan.device_len : span.end - plan.device_len]
            pool.write(part, self._positions(req, span.start, span.end), where)

    def _capture(self, req: Any, up_to: int) -> None:
        assert self.synthesis is not None
        key = _request_key(req)
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        pool = self._slots()

        def read(chunk: RequestChunk) -> ChunkKV:
            slots = row[chunk.start : chunk.end]
            return pool.read(slots, self._positions(req, chunk.start, chunk.end), chunk.key)

        upto = min(up_to, len(req.origin_input_ids))
        self.stats.chunks_captured += self._request(key, req).capture(self.synthesis, upto, read)

    def _positions(self, req: Any, start: int, end: int) -> torch.Tensor:
        """SGLang's positions for ``tokens[start:end]`` of the request: its precomputed M-RoPE
        rows where it has them, else ``start..end`` (`request_positions`)."""
        assert self.layout is not None
        mm = getattr(req, "multimodal_inputs", None)
        mrope = None if mm is None else getattr(mm, "mrope_positions", None)
        if mrope is not None:
            return torch.as_tensor(mrope)[:, start:end].to("cpu", torch.long)
        return request_positions(self.layout, start, end)


def _report(req: Any, plan: LoadPlan) -> None:
    """One log line per request kamera planned for (`ServedReport`): SGLang's outputs carry no
    per-request field for what was loaded, kept (approximate) and refused."""
    _LOG.info("kamera: request %s %s", req.rid, ServedReport.of(plan).describe())


def _request_key(req: Any) -> Any:
    return RadixKey(array("q", req.origin_input_ids), req.extra_key, cache_salt=req.cache_salt)


def _namespace(key: Any) -> str:
    """One tenant's chunks: SGLang's ``extra_key`` and ``cache_salt`` namespace its tree too."""
    return namespace_of(key.extra_key or "", key.cache_salt or "")
