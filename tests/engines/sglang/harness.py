"""Drive SGLang 0.5.23's real scheduler-side admission path on CPU over any radix cache.

No mock of SGLang: the requests are real ``Req`` objects, admission is a real ``PrefillAdder``,
the batch is a real ``ScheduleBatch`` (``prepare_for_extend`` / ``prepare_for_decode`` allocate
through SGLang's own ``alloc_for_extend`` / ``alloc_for_decode``), and publishing and releasing go
through ``checkpoint_kv_cache`` / ``release_kv_cache`` exactly as the scheduler's result processor
calls them. Only the model forward is simulated: the caller gets each new slot range and may write
KV there (by default the harness stamps every slot with its token id and position, so a test can
check what a reused prefix holds).

Which scheduler code each step mirrors (paths under ``sglang/srt/``):

* admission, ``Admission.admit`` -- ``managers/scheduler.py`` ``_get_new_batch_prefill_raw``
  (4079-4357): ``self.policy.calc_priority`` (4129), ``PrefillAdder(...)`` (4157), per waiting
  request ``req.init_next_round_input(tree_cache)`` (4260: ``common.match_kv_cache`` ->
  ``tree_cache.match_prefix``) then ``adder.add_one_req`` (4270; ``schedule_policy.py`` 1395, which
  calls ``tree_cache.init_load_back`` at 1517 when ``req.needs_host_load_back()`` and locks
  ``req.last_node`` in ``_commit_prefill_admission`` at 1690), ``ScheduleBatch.init_new`` (4335)
  and ``prepare_for_extend`` (4357; ``mem_cache/allocation.py`` ``alloc_for_extend`` 374 writes
  ``tree_cache.prefix_device_indices(req)`` then ``out_cache_loc`` into the row);
* prefill result, ``Admission.prefill`` -- ``managers/scheduler_components/
  batch_result_processor.py`` ``process_batch_result_prefill`` (258): ``output_ids.append`` (365),
  ``update_finish_state``, then ``release_kv_cache(req, tree, checkpoint=True)`` (387) or
  ``checkpoint_kv_cache(req, tree)`` (394), inside ``free_group_begin/end``; then the merge of the
  prefill batch into the running batch of ``scheduler.py`` ``get_next_batch_to_run`` (3894);
* chunked prefill (``chunked_prefill_size``, SGLang's ``--chunked-prefill-size``; its default is on):
  a prompt longer than the chunk is admitted as ``adder.new_chunked_req`` (``scheduler.py`` 4324,
  ``inflight_middle_chunks += 1`` at 4330, ``ScheduleBatch.init_new(..., chunked_req=...)`` and
  ``contains_last_prefill_chunk`` at 4335-4348); a middle chunk samples nothing and publishes
  nothing (``batch_result_processor.py`` 426: ``inflight_middle_chunks -= 1``); before the merge,
  ``get_next_batch_to_run`` stashes it (3911-3919: ``stash_chunked_request`` ->
  ``checkpoint_kv_cache``) and keeps it out of the running batch; the next pass continues it first
  (4176-4184: ``init_next_round_input()``, ``shortest_prefill_chunk_limit``, ``add_chunked_req``);
* decode, ``Admission.decode`` -- ``scheduler.py`` ``update_running_batch`` (4459: ``filter_batch``,
  ``check_decode_mem``, ``retract_decode``, ``prepare_for_decode``) and ``process_batch_result_decode``
  (batch_result_processor.py 952: ``output_ids.extend`` (1046), ``update_finish_state``,
  ``release_kv_cache(..., checkpoint=True)`` at 1466); retracted requests rejoin the waiting
  queue as ``Scheduler._add_request_to_queue`` (3480) appends them;
* eviction, ``Admission.evict`` -- ``tree_cache.evict(EvictParams(num_tokens=...))``; allocation
  under pressure also evicts by itself through ``mem_cache/allocation.py`` ``alloc_token_slots`` /
  ``alloc_paged_token_slots_extend`` -> ``common.evict_from_tree_cache``;
* the leak check, ``Admission.check`` -- ``scheduler_components/invariant_checker.py``:
  ``available + evictable + protected + sum(kv_private_tokens) == total`` and every
  ``req_to_token`` row free when idle, plus a census of slot ids (free, tree, request-owned:
  disjoint, and together every page of the pool).

SGLang reads process-wide configuration (``get_exec()``, ``get_spec()``, ``get_serving()``, ...) on
this path and fails with ``config namespace 'exec' not published`` without it. The harness builds a
private ``RuntimeContext`` from a real ``ServerArgs`` with ``runtime_context.create_context(...,
role="scheduler")`` and activates it with ``use_context`` around every call into SGLang, so the
process-wide context (which other tests ``publish``) is left as it was.
"""

from __future__ import annotations

import functools
import itertools
from array import array
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kamera_agent.demo.model import DEMO_MODEL_DIR

__all__ = ["EOS", "Admission", "HarnessError", "stamp_kv"]

EOS = 2
"""The end-of-sequence id every harness request carries; a request that samples it finishes."""

OnExtend = Callable[[Any, torch.Tensor, int, int], None]
"""``on_extend(req, slots, start, end)``: the forward wrote KV for fill ids ``[start, end)`` into
``slots`` (``slots[i]`` holds position ``start + i``)."""


class HarnessError(AssertionError):
    """A harness invariant failed (a leak, a double owner, a misuse of the harness)."""


@functools.lru_cache(maxsize=8)
def _context(model_dir: str, page_size: int, chunked_prefill_size: int) -> Any:
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=model_dir, device="cpu", page_size=page_size, chunked_prefill_size=chunked_prefill_size
    )
    return create_context(server_args, role="scheduler")


@functools.lru_cache(maxsize=8)
def _model_config(model_dir: str) -> Any:
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(model_dir)


def stamp_kv(kv_pool: Any, req: Any, slots: torch.Tensor, start: int, end: int) -> None:
    """The default forward: every layer's K at ``slot`` gets ``[token, position, ...]`` (channel 0
    and 1), V gets the same; ``Admission.kv_stamp`` reads it back."""
    if end <= start:
        return
    tokens = torch.tensor((req.origin_input_ids + req.output_ids)[start:end], dtype=torch.float32)
    positions = torch.arange(start, end, dtype=torch.float32)
    index = slots.to(torch.int64)
    for layer in range(kv_pool.layer_num):
        for buffer in (kv_pool.get_key_buffer(layer), kv_pool.get_value_buffer(layer)):
            buffer[index, :, 0] = tokens[:, None]
            buffer[index, :, 1] = positions[:, None]


def _default_next_token(req: Any) -> int:
    # Deterministic, never EOS, inside the demo vocabulary.
    return 10 + (sum(req.origin_input_ids[:8]) + 7 * len(req.output_ids)) % 200


class Admission:
    """Real pools, a real allocator and one tree cache, driven like SGLang's scheduler drives them.

    ``tree_cache_factory(params: CacheInitParams)`` builds the cache (``RadixCache`` itself, a
    subclass, or a lambda). ``page_size`` 1 uses ``TokenToKVPoolAllocator``, larger ones
    ``PagedTokenToKVPoolAllocator``. ``size`` is the KV pool in tokens, ``max_requests`` the
    ``req_to_token`` rows. ``chunked_prefill_size`` is SGLang's ``--chunked-prefill-size``: ``None``
    turns chunked prefill off (``-1``: a prompt must fit one prefill), a size prefills a longer
    prompt over several passes (``chunked``: the request between them). ``schedule_policy`` is
    SGLang's ``--schedule-policy`` (``"lpm"`` re-matches every waiting request on each pass).
    ``on_extend`` replaces the default forward (``stamp_kv``) for every step; ``next_token(req)``
    is the sampler (never ``EOS`` unless the request is told to stop); ``kv_pool(size, page_size)``
    builds another pool than the default MHA one (an MLA pool for DeepSeek).
    """

    def __init__(
        self,
        tree_cache_factory: Callable[[Any], Any],
        *,
        page_size: int = 1,
        size: int = 2048,
        max_requests: int = 64,
        max_context_len: int = 1024,
        layers: int = 4,
        heads: int = 2,
        head_dim: int = 32,
        max_prefill_tokens: int = 16384,
        new_token_ratio: float = 0.7,
        schedule_policy: str = "fcfs",
        chunked_prefill_size: int | None = None,
        model_dir: str | Path = DEMO_MODEL_DIR,
        next_token: Callable[[Any], int] = _default_next_token,
        on_extend: OnExtend | None = None,
        kv_pool: Callable[[int, int], Any] | None = None,
    ) -> None:
        self.page_size = page_size
        self.max_prefill_tokens = max_prefill_tokens
        self.new_token_ratio = new_token_ratio
        self.next_token = next_token
        self.chunked_prefill_size = chunked_prefill_size
        self._context = _context(str(model_dir), page_size, chunked_prefill_size or -1)
        with self.active():
            from sglang.srt.managers.schedule_batch import ScheduleBatch
            from sglang.srt.managers.schedule_policy import SchedulePolicy
            from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
            from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

            self.model_config = _model_config(str(model_dir))
            self.req_to_token_pool = ReqToTokenPool(
                size=max_requests, max_context_len=max_context_len, device="cpu", enable_memory_saver=False
            )
            self.kv_pool = (
                kv_pool(size, page_size)
                if kv_pool is not None
                else MHATokenToKVPool(
                    size,
                    page_size,
                    torch.float32,
                    heads,
                    head_dim,
                    layers,
                    "cpu",
                    False,
                    enable_alt_stream=False,
                )
            )
            if page_size == 1:
                self.allocator = TokenToKVPoolAllocator(
                    size, torch.float32, "cpu", self.kv_pool, need_sort=False
                )
            else:
                self.allocator = PagedTokenToKVPoolAllocator(
                    size, page_size, torch.float32, "cpu", self.kv_pool, need_sort=False
                )
            self.params = CacheInitParams(
                disable=False,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=page_size,
            )
            self.tree_cache = tree_cache_factory(self.params)
            self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
            self.policy = SchedulePolicy(schedule_policy, self.tree_cache, False, False, True)
        self.on_extend: OnExtend = on_extend or self._stamp
        self.capacity = self.allocator.available_size()
        """Every slot of the pool, page-aligned: what ``free_slots()`` must return once idle and evicted."""
        self.row_capacity = self.req_to_token_pool.available_size()
        self.waiting: list[Any] = []
        self.chunked: Any = None
        """The request chunked prefill is part way through (SGLang's ``Scheduler.chunked_req``)."""
        self.batch: Any = None
        """The prefill batch ``admit`` prepared and ``prefill`` has not run yet."""
        self.finished: list[Any] = []
        self.retracted: list[Any] = []
        self._rids = itertools.count()

    # ----- context -----

    @contextmanager
    def active(self) -> Iterator[None]:
        """Activate the harness's SGLang runtime context (for a test's own calls into SGLang)."""
        from sglang.srt.runtime_context import use_context

        with use_context(self._context):
            yield

    # ----- requests -----

    def request(
        self,
        tokens: Iterable[int],
        *,
        extra_key: str | None = None,
        max_new_tokens: int = 1,
        rid: str | None = None,
    ) -> Any:
        """A new ``Req`` for ``tokens`` (not queued), as ``Scheduler.handle_generate_request`` builds it."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        with self.active():
            params = SamplingParams(max_new_tokens=max_new_tokens)
            params.normalize(None)
            params.verify(self.model_config.vocab_size)
            return Req(
                rid if rid is not None else f"r{next(self._rids)}",
                "",
                array("q", tokens),
                params,
                eos_token_ids={EOS},
                vocab_size=self.model_config.vocab_size,
                extra_key=extra_key,
            )

    @property
    def running(self) -> list[Any]:
        """Requests past their prefill and not finished (the scheduler's running batch)."""
        return [r for r in self.running_batch.reqs if not r.finished()]

    # ----- steps 2-4: admission -----

    def admit(self, reqs: Iterable[Any] = ()) -> list[Any]:
        """Queue ``reqs`` and run one prefill scheduling pass over the waiting queue; return the
        admitted requests (their prefill batch is prepared in ``self.batch``; the rest keep waiting)."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
        from sglang.srt.runtime_context import get_schedule
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        if self.batch is not None:
            raise HarnessError("the last admitted batch has not run: call prefill() first")
        self.waiting.extend(r for r in reqs if r not in self.waiting)
        with self.active():
            running = self.running_batch
            running.filter_batch()
            if running.is_empty():
                running.batch_is_full = False
            if not self.waiting and self.chunked is None:
                return []
            self.policy.calc_priority(self.waiting, running, processed_tokens=0)
            adder = PrefillAdder(
                self.page_size,
                self.tree_cache,
                self.allocator,
                running,
                self.new_token_ratio,
                self.max_prefill_tokens,
                self.chunked_prefill_size,
                0,
                0,
                max_prefill_bs=0,
                max_running_requests=None,
                prefill_max_requests=get_schedule().prefill_max_requests,
                prefill_delayer_single_pass=None,
                dllm_config=None,
                waiting_queue_len=len(self.waiting),
                prefill_tile_block_m=64,
            )
            if self.chunked is not None:  # its next chunk goes first
                self.chunked.init_next_round_input()
                adder.chunked_req_limit = self.policy.shortest_prefill_chunk_limit(
                    self.chunked, self.waiting, adder.rem_chunk_tokens or 0, self.page_size
                )
                self.chunked = adder.add_chunked_req(self.chunked)
            for req in self.waiting:
                if adder.budget_state() == AddReqResult.OTHER:
                    break
                rows = self.req_to_token_pool.available_size()
                held = sum(r.kv.holds_kv for r in adder.can_run_list)  # a continued chunk has its row
                if len(adder.can_run_list) - held >= rows:
                    running.batch_is_full = True
                    break
                req.init_next_round_input(self.tree_cache)
                result = adder.add_one_req(
                    req, has_chunked_req=self.chunked is not None, truncation_align_size=None
                )
                if result != AddReqResult.CONTINUE:
                    if result == AddReqResult.NO_TOKEN:
                        running.batch_is_full = bool(adder.can_run_list) or not running.is_empty()
                    break
            admitted = list(adder.can_run_list)
            if not admitted:
                return []
            self.waiting = [r for r in self.waiting if r not in admitted]
            if adder.new_chunked_req is not None:
                if self.chunked is not None:
                    raise HarnessError(
                        f"two chunked requests: {self.chunked.rid}, {adder.new_chunked_req.rid}"
                    )
                self.chunked = adder.new_chunked_req
            if self.chunked is not None:
                self.chunked.inflight_middle_chunks += 1
            continued = [r for r in admitted if r.kv.holds_kv]
            batch = ScheduleBatch.init_new(
                admitted,
                self.req_to_token_pool,
                self.allocator,
                self.tree_cache,
                self.model_config,
                False,  # enable_overlap
                SpeculativeAlgorithm.NONE,
                chunked_req=self.chunked,
            )
            batch.contains_last_prefill_chunk = self.chunked is None or len(admitted) != 1
            rows = {id(r): self.row(r, r.prefix_len).clone() for r in continued}
            batch.prepare_for_extend()
            self.batch = batch
            self._check_batch(batch, rows)
        return admitted

    def _check_batch(self, batch: Any, continued: dict[int, torch.Tensor]) -> None:
        # What prepare_for_extend promises: each row starts with the matched prefix as the tree
        # reports it (a continued chunk: the row as its last chunk left it, the published part
        # the tree's), then the slots out_cache_loc handed out for the extend.
        start = 0
        for req in batch.reqs:
            new = batch.out_cache_loc[start : start + req.extend_len].to(torch.int64)
            start += req.extend_len
            row = self.row(req, req.extend_end)
            if id(req) in continued:
                protected = req.kv.cache_protected_len
                tree = self.tree_cache.path_device_indices(req.last_node).to(torch.int64)
                if not torch.equal(row[: req.prefix_len], continued[id(req)]):
                    raise HarnessError(f"{req.rid}: a continued chunk's row prefix changed")
                if not torch.equal(row[:protected], tree[:protected]):
                    raise HarnessError(f"{req.rid}: req_to_token[:cache_protected_len] is not the tree's")
            elif req.prefix_len and not torch.equal(
                row[: req.prefix_len], self.tree_cache.prefix_device_indices(req).to(torch.int64)
            ):
                raise HarnessError(f"{req.rid}: req_to_token[:prefix_len] is not the tree's prefix")
            if not torch.equal(row[req.prefix_len :], new):
                raise HarnessError(f"{req.rid}: req_to_token[prefix_len:] is not out_cache_loc")
            if req.kv.cache_protected_len % self.page_size or req.kv.cache_protected_len > req.prefix_len:
                raise HarnessError(
                    f"{req.rid}: cache_protected_len {req.kv.cache_protected_len} "
                    f"(prefix_len {req.prefix_len}, page {self.page_size})"
                )

    def new_slots(self, req: Any) -> torch.Tensor:
        """The slots ``prepare_for_extend`` allocated for ``req`` in the pending batch (``out_cache_loc``)."""
        if self.batch is None or req not in self.batch.reqs:
            raise HarnessError(f"{req.rid} is not in the pending prefill batch")
        start = 0
        for other in self.batch.reqs:
            if other is req:
                return self.batch.out_cache_loc[start : start + req.extend_len]
            start += other.extend_len
        raise AssertionError("unreachable")

    def row(self, req: Any, end: int | None = None) -> torch.Tensor:
        """``req_to_token[req.kv.req_pool_idx, :end]`` (int64); ``end`` defaults to the allocated length."""
        if req.kv.req_pool_idx is None:
            raise HarnessError(f"{req.rid} holds no req_to_token row")
        stop = req.kv.kv_allocated_len if end is None else end
        return self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :stop].to(torch.int64)

    # ----- step 5: the simulated forward and its result -----

    def prefill(self, on_extend: OnExtend | None = None, *, stop: Iterable[Any] = ()) -> list[Any]:
        """Run the pending prefill batch: ``on_extend`` for each request's new slots, sample one token
        (EOS for requests in ``stop``), then finish-and-release or checkpoint each request as
        ``process_batch_result_prefill`` does (a middle chunk does neither), stash the chunked
        request, and merge the rest into the running batch. Returns the requests that finished."""
        if self.batch is None:
            raise HarnessError("no admitted batch: call admit() first")
        batch, self.batch = self.batch, None
        write = on_extend or self.on_extend
        stopping = set(map(id, stop))
        with self.active():
            from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

            start = 0
            for req in batch.reqs:
                slots = batch.out_cache_loc[start : start + req.extend_len]
                start += req.extend_len
                write(req, slots, req.prefix_len, req.extend_end)
            done = []
            self.allocator.free_group_begin()
            try:
                for req in batch.reqs:
                    if req.inflight_middle_chunks > 0:  # a middle chunk: no token, nothing published
                        req.inflight_middle_chunks -= 1
                        continue
                    req.output_ids.append(EOS if id(req) in stopping else self.next_token(req))
                    req.update_finish_state()
                    if req.finished():
                        release_kv_cache(req, self.tree_cache, checkpoint=True)
                        done.append(req)
                    else:
                        checkpoint_kv_cache(req, self.tree_cache)
            finally:
                self.allocator.free_group_end()
            # get_next_batch_to_run: stash the chunked request (publish its chunk), filter the
            # prefill batch without it, merge the rest into the running batch.
            chunked = self.chunked
            if chunked is not None and chunked.extend_end > chunked.prefix_len:
                checkpoint_kv_cache(chunked, self.tree_cache)
            batch.filter_batch(reqs_to_exclude=[chunked] if chunked is not None else None)
            if not batch.is_empty():
                if self.running_batch.is_empty():
                    self.running_batch = batch
                else:
                    self.running_batch.merge_batch(batch)
        self.finished.extend(done)
        return done

    def decode(self, on_extend: OnExtend | None = None, *, stop: Iterable[Any] = ()) -> list[Any]:
        """One decode step of the running batch: ``update_running_batch`` (retracting under memory
        pressure: retracted requests go back to ``waiting``), ``prepare_for_decode``, ``on_extend`` for
        each request's one new slot, then sample (EOS for requests in ``stop``) and release finished
        requests as ``process_batch_result_decode`` does. Returns the requests that finished."""
        write = on_extend or self.on_extend
        stopping = set(map(id, stop))
        with self.active():
            from sglang.srt.mem_cache.common import release_kv_cache

            batch = self.running_batch
            batch.filter_batch()
            if batch.is_empty():
                return []
            if not batch.check_decode_mem():
                retracted, ratio, aborted = batch.retract_decode()
                self.new_token_ratio = ratio
                if aborted:
                    raise HarnessError(f"decode aborted {[r.rid for r in aborted]}: the pool is too small")
                self.retracted.extend(retracted)
                self.waiting.extend(retracted)  # Scheduler._add_request_to_queue appends them
                if batch.is_empty():
                    return []
            batch.prepare_for_decode()
            for i, req in enumerate(batch.reqs):
                position = req.kv.kv_committed_len - 1
                write(req, batch.out_cache_loc[i : i + 1], position, position + 1)
            done = []
            self.allocator.free_group_begin()
            try:
                for req in batch.reqs:
                    req.output_ids.append(EOS if id(req) in stopping else self.next_token(req))
                    req.update_finish_state(1)
                    if req.finished():
                        release_kv_cache(req, self.tree_cache, checkpoint=True)
                        done.append(req)
            finally:
                self.allocator.free_group_end()
            batch.filter_batch()
        self.finished.extend(done)
        return done

    def finish(self, *reqs: Any, on_extend: OnExtend | None = None) -> list[Any]:
        """Finish ``reqs`` now: if they are in the pending prefill batch, run it with them sampling
        EOS; running ones sample EOS in one decode step of the whole running batch (the other
        running requests decode a token too). Returns every request that finished on the way."""
        done: list[Any] = []
        pending = [r for r in reqs if not r.finished()]
        if self.batch is not None and any(r in self.batch.reqs for r in pending):
            done += self.prefill(on_extend, stop=pending)
        pending = [r for r in pending if not r.finished()]
        running = self.running
        for req in pending:
            if req not in running:
                raise HarnessError(f"{req.rid} is neither admitted nor running")
        if pending:
            done += self.decode(on_extend, stop=pending)
        return done

    def drain(self, on_extend: OnExtend | None = None) -> list[Any]:
        """Run the pending batch and the chunked request's remaining chunks (waiting requests the
        scheduler admits beside them included), then finish every running request (other waiting
        ones stay queued)."""
        done: list[Any] = []
        if self.batch is not None:
            done += self.prefill(on_extend)
        while self.chunked is not None:
            if not self.admit():
                raise HarnessError(f"{self.chunked.rid}: its next chunk cannot be admitted")
            done += self.prefill(on_extend)
        if self.running:
            done += self.finish(*self.running, on_extend=on_extend)
        return done

    # ----- step 6: eviction -----

    def evict(self, tokens: int) -> int:
        """``tree_cache.evict(EvictParams(num_tokens=tokens))``; returns the tokens it evicted."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        with self.active():
            return self.tree_cache.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted

    def evict_all(self) -> int:
        """Evict until nothing evictable is left; returns the tokens evicted."""
        total = 0
        while True:
            with self.active():
                want = self.tree_cache.evictable_size()
            evicted = self.evict(max(want, 1)) if want else 0
            total += evicted
            if evicted == 0:
                return total

    # ----- accounting -----

    def free_slots(self) -> int:
        """``allocator.available_size()``: free slots (whole pages when paged)."""
        return self.allocator.available_size()

    def live_requests(self) -> list[Any]:
        """Requests holding a ``req_to_token`` row: the pending batch, the running batch and the
        chunked request."""
        live = list(self.running_batch.reqs)
        if self.batch is not None:
            live += self.batch.reqs
        if self.chunked is not None and all(r is not self.chunked for r in live):
            live.append(self.chunked)
        return [r for r in live if r.kv.holds_kv]

    def private_tokens(self) -> int:
        """KV the live requests own outside the tree: ``sum(kv_private_tokens(req.kv, page_size))``."""
        from sglang.srt.managers.scheduler_components.pool_stats_observer import kv_private_tokens

        return sum(kv_private_tokens(r.kv, self.page_size) for r in self.live_requests())

    def accounting(self) -> dict[str, int]:
        """The scheduler's conservation terms (``SchedulerInvariantChecker._check_full_pool``)."""
        with self.active():
            return {
                "total": self.capacity,
                "available": self.allocator.available_size(),
                "evictable": self.tree_cache.evictable_size(),
                "protected": self.tree_cache.protected_size(),
                "uncached": self.private_tokens(),
            }

    def leaked(self) -> int:
        """``total - (available + evictable + protected + uncached)``: 0 when nothing leaked."""
        terms = self.accounting()
        return terms["total"] - (
            terms["available"] + terms["evictable"] + terms["protected"] + terms["uncached"]
        )

    def tree_slots(self) -> torch.Tensor:
        """Every slot the tree holds: the values of all non-evicted nodes under ``root_node``."""
        values = []
        stack = [self.tree_cache.root_node]
        while stack:
            node = stack.pop()
            if node is not self.tree_cache.root_node and node.value is not None:
                values.append(node.value.to(torch.int64))
            stack.extend(child for child in node.children.values() if child.value is not None)
        return torch.cat(values) if values else torch.empty((0,), dtype=torch.int64)

    def _pages(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.div(slots, self.page_size, rounding_mode="floor")

    def census(self) -> dict[str, torch.Tensor]:
        """Page ids by owner: ``free`` (the allocator), ``tree``, and ``requests`` (each live request's
        row past ``cache_protected_len``). Counted with multiplicity so a double owner shows."""
        free = self.allocator.get_all_free_pages()
        free = free.to(torch.int64) if free is not None else torch.empty((0,), dtype=torch.int64)
        tree = self.tree_slots()
        if self.page_size > 1:
            tree = torch.unique(self._pages(tree))
        owned = []
        for req in self.live_requests():
            row = self.row(req)[req.kv.cache_protected_len :]
            owned.append(torch.unique(self._pages(row)) if self.page_size > 1 else row)
        requests = torch.cat(owned) if owned else torch.empty((0,), dtype=torch.int64)
        return {"free": free, "tree": tree, "requests": requests}

    def check(self) -> None:
        """Raise ``HarnessError`` unless the pool is conserved: the scheduler's accounting identity
        holds, no page has two owners, every page has one, every live request's protected prefix
        (``row[:cache_protected_len]``) is still in the tree, and the rows are accounted for."""
        leak = self.leaked()
        if leak:
            raise HarnessError(f"{leak} slots unaccounted for: {self.accounting()}")
        with self.active():
            census = self.census()
        pages = torch.cat(list(census.values()))
        unique, counts = torch.unique(pages, return_counts=True)
        if (counts > 1).any():
            twice = unique[counts > 1].tolist()[:10]
            owners = {name: sorted(set(v.tolist()) & set(twice)) for name, v in census.items()}
            raise HarnessError(f"pages with two owners: {twice} ({owners})")
        num_pages = self.capacity // self.page_size
        expected = torch.arange(1, num_pages + 1, dtype=torch.int64)
        if not torch.equal(unique, expected):
            missing = sorted(set(expected.tolist()) - set(unique.tolist()))[:10]
            raise HarnessError(f"pages owned by no one: {missing}")
        in_tree = set(census["tree"].tolist())
        for req in self.live_requests():
            prefix = self.row(req, req.kv.cache_protected_len)
            pages = torch.unique(self._pages(prefix)) if self.page_size > 1 else prefix
            lost = sorted(set(pages.tolist()) - in_tree)
            if lost:
                raise HarnessError(f"{req.rid} reads a prefix the tree no longer holds: pages {lost[:10]}")
        rows = self.req_to_token_pool.available_size() + len(self.live_requests())
        if rows != self.row_capacity:
            raise HarnessError(f"req_to_token rows: {rows} accounted, {self.row_capacity} in the pool")

    def kv_stamp(self, slots: torch.Tensor, layer: int = 0) -> tuple[list[int], list[int]]:
        """What the default forward stamped into ``slots``: (token ids, positions)."""
        keys = self.kv_pool.get_key_buffer(layer)[slots.to(torch.int64)]
        return keys[:, 0, 0].to(torch.int64).tolist(), keys[:, 0, 1].to(torch.int64).tolist()

    def _stamp(self, req: Any, slots: torch.Tensor, start: int, end: int) -> None:
        stamp_kv(self.kv_pool, req, slots, start, end)
