"""Running a window's operations: one transaction over its state and its store per op.

Why apart from the face: every op (and every read: ask, probe, kv) is the same sequence:
snapshot the state, plan over a staged view of the store, execute, commit, or restore and
re-plan when another window changed an orbit under the op. `OpRunner` owns that sequence and the
window's `WindowRecord` (a failed op replaces it with its snapshot); `WindowParts` is what a
window and its forks share.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from kamera_agent.backends.base import Backend, DecodeConfig
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.config import WindowConfig
from kamera_agent.core.costs import CostMeter
from kamera_agent.core.kv_core import KVCore, StaleLookup, Txn
from kamera_agent.core.staging import StagedStore, StoreView
from kamera_agent.critical_path import critical_path
from kamera_agent.divergence import next_token_kl
from kamera_agent.errors import ContextOverflowError, WindowClosedError, WindowError
from kamera_agent.fidelity import AuditSource, DriftBudget, Measure, filed_in
from kamera_agent.results import Answer, OpCost, Plan
from kamera_agent.window.conversation import Conversation
from kamera_agent.window.drift_fixes import DriftFixes
from kamera_agent.window.executor import Executor
from kamera_agent.window.memory import release_evicted
from kamera_agent.window.plan import WindowPlan
from kamera_agent.window.planner import PlanInputs, Planner
from kamera_agent.window.state import Scores, WindowRecord
from kamera_agent.window.tail import with_tail

__all__ = ["Build", "OpRunner", "WindowParts"]

T = TypeVar("T")
Build = Callable[[Planner], WindowPlan]
"""One op's planner call, its arguments parsed and checked already (`Inputs`, `arguments`)."""
_ATTEMPTS = 3  # plans re-made when another window changed an orbit patch under an op
_QUERIES = 64  # query token ids remembered per window family


@dataclass(frozen=True)
class WindowParts:
    """What a window and its forks share: settings, the engine, the core over the store (with the
    window's encoder and anchor), the conversation framing, if any, and the drift budget, if any
    (with the audits it remembers)."""

    config: WindowConfig
    backend: Backend
    core: KVCore
    conversation: Conversation | None
    budget: DriftBudget | None = None
    _queries: dict[tuple[str, bool, str, str], torch.Tensor] = field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def encoder(self) -> ChunkEncoder:
        """The window's own encoder (a conversation's carries its system prompt as the anchor)."""
        return self.core.encoder

    def query_ids(
        self, query: str, opened: bool = True, role: str = "user", answer_start: str = ""
    ) -> torch.Tensor:
        """The token ids a query is decoded from, framed as the window frames questions (as a
        message of ``role`` in a conversation), ``answer_start`` after the assistant's opening.
        Remembered per query (`_QUERIES` of them): an agent asks the same questions again and
        again, and tokenizing is a fixed cost per call."""
        key = (query, opened, role, answer_start)
        known = self._queries.get(key)
        if known is not None:
            return known
        if self.conversation is not None:
            ids = self.conversation.query_ids(query, opened=opened, role=role, answer_start=answer_start)
        else:
            ids = self.encoder.query_ids(query, answer_start)
        if len(self._queries) >= _QUERIES:
            self._queries.pop(next(iter(self._queries)))  # the oldest first
        self._queries[key] = ids
        return ids


class OpRunner:
    """Plans and executes a window's ops as transactions; owns its `WindowRecord`."""

    def __init__(self, parts: WindowParts, state: WindowRecord) -> None:
        self.parts, self.state = parts, state
        self.lock = threading.RLock()
        """Held by every op and read: a window serializes calls from several threads (each op
        is one transaction; a fork has its own lock, sharing only the thread-safe store)."""
        self.dry: list[WindowPlan] | None = None
        """While a dry run is on (`dry_run`), the plans ops made instead of executing them."""
        self._last: WindowPlan | None = None
        self._last_public: Plan | None = None

    @property
    def last_plan(self) -> Plan | None:
        """The edits the last op (or read) executed: worded when asked (most ops are never shown)."""
        last = self._last
        if last is not None and self._last_public is None:
            self._last_public = last.public()
        return self._last_public

    def transact(self, op: str, build: Build) -> tuple[WindowPlan, OpCost]:
        """Plan and execute ``op`` as one transaction over window and store; record its cost.
        During a dry run: only plan it, over the store as it is (nothing runs, nothing changes)."""
        with self.lock:
            return self._transact(op, build)

    def _transact(self, op: str, build: Build) -> tuple[WindowPlan, OpCost]:
        self.check_open()
        if self.dry is not None:
            plan = self._planned(build, self.parts.core.store)
            self.dry.append(plan)
            return plan, OpCost()
        plan, (_, cost) = self._run(op, build, None)
        return plan, cost

    @contextmanager
    def dry_run(self) -> Iterator[list[WindowPlan]]:
        """Ops called inside this block plan and do not execute; the plans are collected."""
        with self.lock:  # another thread's op must not run as a dry one, nor this one's for real
            if self.dry is not None:
                raise WindowError("a dry run is already on for this window; plan one op at a time")
            self.dry = []
            try:
                yield self.dry
            finally:
                self.dry = None

    def read(self, op: str, read: Callable[[Executor], T], materialize: bool = True) -> tuple[T, OpCost]:
        """Read the window (ask, probe, kv) in one transaction, lazy patches formed first."""
        with self.lock:
            self.check_open()
            idle = WindowPlan(op, tuple(self.state.order))
            entries = self.state.entries
            due = materialize and any(entries[ref].pending for ref in self.state.order)
            # nothing deferred: the materializing plan would only rotate every chunk in place
            build: Build = (lambda planner: planner.materialize(self.state)) if due else (lambda _: idle)
            _, (value, cost) = self._run(op, build, read)
        assert value is not None
        return value, cost

    def check_open(self) -> None:
        """Refuse any op or read once the window's store is closed (`WindowClosedError`)."""
        if self.parts.core.store.closed:
            raise WindowClosedError(
                "this window was closed (its store is closed, so nothing more would be stored); "
                "create a new window, over the same disk_dir or store_url to reuse what it stored"
            )

    def check_context(self, plan: WindowPlan) -> None:
        """Refuse a plan whose window would not fit the model's context with one query token,
        before any forward runs (as `ask` refuses an answer that would not fit)."""
        limit = self.parts.core.backend.context_limit
        if limit is None:
            return
        entries, anchor = self.state.entries, self.parts.core.anchor
        chunks = [plan.chunks[ref] if ref in plan.chunks else entries[ref].chunk for ref in plan.order]
        end = anchor.advance + sum(chunk.advance for chunk in chunks)
        if end + 1 > limit:
            raise ContextOverflowError(
                f"{plan.op} would make the window {end} positions long ({len(chunks)} chunks and the "
                f"anchor); with one query token that exceeds the model's context of {limit}. Slide or "
                "evict chunks first, or set capacity_tokens so the window makes room itself"
            )

    def planner(self, view: StoreView) -> Planner:
        """A planner over the window's settings and a store view."""
        core, layout = self.parts.core, self.parts.core.backend.layout
        inputs = PlanInputs(
            config=self.parts.config,
            view=view,
            root=core.root,
            features=layout.features,
            kv_bytes_per_token=layout.bytes_per_token(core.backend.dtype),
            query_tokens=lambda query: int(self.parts.query_ids(query).shape[0]),
            gaps=core.backend.supports_gaps,
            budget=self.parts.budget,
        )
        return Planner(inputs)

    def _planned(self, build: Build, view: StoreView) -> WindowPlan:
        """The op's plan over ``view``, reusing what the last decode left in the retained cache
        where the op's new chunks repeat it (`with_tail`)."""
        return with_tail(self.state, build(self.planner(view)), self.parts.core.backend.supports_gaps)

    def with_answer(
        self, executor: Executor, query: str, query_ids: torch.Tensor, config: DecodeConfig
    ) -> Answer:
        """The last greedy answer to ``query`` when the window has not changed since, else a decode."""
        last = self.state.last_answer
        if last is not None and last.query == query and last.tick == self.state.tick:
            return last.answer
        return executor.answer(query_ids, config)

    def end(self) -> int:
        """The position after the window's last chunk (where a query starts)."""
        entries = self.state.entries
        return self.parts.core.anchor.advance + sum(entries[r].chunk.advance for r in self.state.order)

    def _run(
        self, op: str, build: Build, read: Callable[[Executor], T] | None
    ) -> tuple[WindowPlan, tuple[T | None, OpCost]]:
        core, config, meter = self.parts.core, self.parts.config, CostMeter()
        for _ in range(_ATTEMPTS):
            snapshot = self.state.copy()
            txn = Txn(StagedStore(core.store), meter)
            try:
                plan = self._planned(build, txn.store)
                if plan.probes:
                    self._score(plan, txn)
                    plan = self._planned(build, txn.store)
                self.check_context(plan)
                executor = Executor(self.state, core, txn, config)
                with critical_path():  # from the op's first forward to its answer: no host round trip
                    plan = self._execute(plan, executor, txn)
                    value = read(executor) if read is not None else None
            except StaleLookup:
                self.state = _restored(snapshot)
                continue
            except BaseException:
                self.state = _restored(snapshot)
                raise
            txn.commit()
            self._last, self._last_public = plan, None
            release_evicted(self.state, core.store, config, plan.evicted, meter)
            cost = meter.finish()
            self.state.book.record(op, cost)
            return plan, (value, cost)
        raise WindowError(f"{op}: the store kept changing under the operation; try it again")

    def _execute(self, plan: WindowPlan, executor: Executor, txn: Txn) -> WindowPlan:
        """Run ``plan`` and hold the window within its drift budget (`DriftFixes`): the chunks
        left of the plan's trailing formations (`WindowPlan.trailing_from`) are audited and fixed
        first, and those formed after, over what stands (re-planned where a fix changed it)."""
        budget, end, entries = self.parts.budget, plan.trailing_from, self.state.entries
        trailing = frozenset(plan.order[end:] if end is not None else ())
        head = tuple(step for step in plan.steps if step.ref not in trailing)
        last = tuple(step for step in plan.steps if step.ref in trailing)
        executor.run(plan, head)
        if budget is None or any(entries[ref].pending for ref in self.state.order[:end]):
            executor.perform(last)  # lazy patches are due: the read that forms them holds the budget
            return plan
        left = [entries[ref].state for ref in self.state.order[:end]]
        after = None
        if end is not None:  # a fix changes their left: they are formed then, whatever the store held
            after = (end, sum(entries[ref].chunk.num_tokens for ref in self.state.order[end:]))
        plan = DriftFixes(self, budget, executor, txn, after).run(plan.changed(steps=head))
        if end is None:
            return plan
        if [entries[ref].state for ref in self.state.order[:end]] != left:  # formed over the fixed left
            why = "formed over the chunks the drift budget fixed to its left"
            last = self.planner(txn.store).refill(self.state, end, why).steps
        executor.perform(last)
        txn.meter.drift = max((e for e in self.drift(store=txn.store) if e is not None), default=0.0)
        return plan.changed(steps=(*plan.steps, *last))

    def drift(
        self,
        measure: Measure | None = None,
        until_over: bool = False,
        store: AuditSource | None = None,
        end: int | None = None,
    ) -> list[float | None]:
        """Each in-window chunk's estimated drift (the first ``end``), left to right: 0 where the
        window holds it exactly; ``None`` where it is not estimated (no budget, or not measured).
        Audits filed in ``store`` (default: the window's) count as measured."""
        states = [self.state.entries[ref].state for ref in self.state.order[:end]]
        budget = self.parts.budget
        if budget is not None:
            source = self.parts.core.store if store is None else store
            filed = filed_in(source)
            return budget.estimates(states, self.parts.core.root, measure, until_over, filed)
        out: list[float | None] = []
        ctx = self.parts.core.root
        for state in states:
            ctx = ctx.extend(state)
            out.append(0.0 if ctx.exact else None)
        return out

    def _score(self, plan: WindowPlan, txn: Txn) -> None:
        """Run the probes a probe-driven eviction asked for; remember their KLs for the re-plan."""
        executor = Executor(self.state, self.parts.core, txn, self.parts.config)
        executor.run(self.planner(txn.store).materialize(self.state))
        query, config = plan.probe_query, DecodeConfig(max_new_tokens=1)
        query_ids = self.parts.query_ids(query)
        with_chunk = self.with_answer(executor, query, query_ids, config)
        kl = {  # a ranking: canonical views, formed once for all the probes (`answer_without`)
            ref: next_token_kl(
                with_chunk.first_logits,
                executor.answer_without(ref, query_ids, config, exact=False).first_logits,
            )
            for ref in plan.probes
        }
        txn.meter.add(probes=len(kl))
        self.state.scores = Scores(query, self.state.tick, kl)


def _restored(snapshot: WindowRecord) -> WindowRecord:
    """The snapshot an op failed back to, without the assembled cache: the op may have cropped
    or extended that engine cache in place, so it no longer holds what the snapshot says."""
    snapshot.assembled = None
    return snapshot
