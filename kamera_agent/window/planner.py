"""Planning window operations: the new order, evictions, admissions and one step per chunk.

Why pure: a planner reads the window's state and a read-only view of the store and returns a
`WindowPlan`; it never runs the model, never writes, never counts a store hit. So
``window.plan(...)`` is a dry run by construction and every rule can be unit-tested.

Each operation (push, reorder, slide/evict, recall, and the materialization of lazy patches
before a read) turns into a new order; the walk goes over it left to right, chaining the
planned states of the chunks to the left into a `Context` and asking the per-chunk rules
(`kamera_agent.window.rules`) what each chunk needs. Two things are the walk's own: a lazily
deferred chunk is formed first whenever a chunk to its right would be patched over it, so
nothing is ever conditioned on a placeholder; and consecutive formations share one forward.
Making room (the eviction policy) is decided here too: a probe-driven policy gets the probes it
needs listed in the plan, and is planned again once they have run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cache, partial

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.core.identity import Context
from kamera_agent.core.staging import can_form
from kamera_agent.errors import (
    CapacityError,
    ChunkInWindowError,
    ChunkLostError,
    DuplicateChunkError,
    StoreLimitError,
    UnknownChunkError,
    WindowError,
)
from kamera_agent.policies import REORDER, SURVIVORS, PatchAction
from kamera_agent.window.plan import Step, WindowPlan
from kamera_agent.window.prefix_bound import PrefixBound
from kamera_agent.window.room import make_room
from kamera_agent.window.rules import LeftContexts, PlanInputs, Rules
from kamera_agent.window.state import ChunkRef, Entry, WindowRecord

__all__ = ["PlanInputs", "Planner"]


Special = Callable[[int, Context], Step]
"""A step decided by the op itself (the pushed chunk, the recalled one) at index ``i`` over ``ctx``."""


class Planner:
    """Builds `WindowPlan` objects for push, reorder, slide/evict, recall and lazy materialization."""

    def __init__(self, inputs: PlanInputs) -> None:
        self.inputs, self.config, self.view, self.root = inputs, inputs.config, inputs.view, inputs.root
        self.rank = inputs.config.effective_rank
        self.rules = Rules(inputs)
        self.bound = PrefixBound(inputs, self.rules)

    # -- operations ---------------------------------------------------------------------------
    def push(self, state: WindowRecord, chunk: Chunk, label: str | None) -> WindowPlan:
        return self.extend(state, [(chunk, label)], "push")

    def extend(
        self, state: WindowRecord, items: Sequence[tuple[Chunk, str | None]], op: str = "extend"
    ) -> WindowPlan:
        """New chunks at the right end, in order: consecutive formations, so one forward for all."""
        if not items:
            raise WindowError(f"{op} needs at least one chunk")
        chunks = {state.mint(chunk, label, i): chunk for i, (chunk, label) in enumerate(items)}
        for chunk in chunks.values():
            self._check_storable(chunk)
        tokens, count = sum(chunk.num_tokens for chunk in chunks.values()), len(chunks)
        evicted, probes = make_room(self.config, state, tokens, pinned=(), count=count)
        if probes:  # a dry run shows the FIFO outcome; the real one is planned after the probes
            placeholder, _ = make_room(self.config, state, tokens, pinned=(), scores={}, count=count)
            plan = self._admit(state, op, chunks, placeholder)
            return self._with_probes(state, plan, probes)
        return self._admit(state, op, chunks, evicted)

    def replace(
        self,
        state: WindowRecord,
        ref: ChunkRef,
        chunk: Chunk,
        label: str | None,
        append: Sequence[tuple[Chunk, str | None]] = (),
    ) -> WindowPlan:
        """``chunk`` takes ``ref``'s slot and ``ref`` is evicted; the chunks to its right are
        survivors of that eviction (they keep what they absorbed from ``ref`` under
        ``survivors="keep"``: a caption or summary replacing a screenshot leaves them encoding the
        screenshot itself). ``append``: new chunks at the right end in the same op (where the
        engine supports gaps, their formation shares the replacement's forward)."""
        _in_window(state, ref)
        new = state.mint(chunk, label)
        appended = {state.mint(c, name, 1 + i): c for i, (c, name) in enumerate(append)}
        for admitted in (chunk, *appended.values()):
            self._check_storable(admitted)
        tokens = chunk.num_tokens + sum(c.num_tokens for c in appended.values())
        count = 1 + len(appended)
        evicted, probes = make_room(self.config, state, tokens, pinned=(), gone=(ref,), count=count)
        if probes:
            placeholder, _ = make_room(
                self.config, state, tokens, pinned=(), scores={}, gone=(ref,), count=count
            )
            plan = self._admit(state, "replace", {new: chunk}, [ref, *placeholder], at=ref, appended=appended)
            return self._with_probes(state, plan, probes)
        return self._admit(state, "replace", {new: chunk}, [ref, *evicted], at=ref, appended=appended)

    def reorder(self, state: WindowRecord, refs: Sequence[ChunkRef]) -> WindowPlan:
        order = tuple(refs)
        for ref in order:
            _in_window(state, ref)
        if len(set(order)) != len(order):
            duplicate = next(ref for ref in order if order.count(ref) > 1)
            raise DuplicateChunkError(f"{duplicate} appears twice in the new order; name each chunk once")
        named = set(order)
        missing = [ref for ref in state.order if ref not in named]
        if missing:
            raise UnknownChunkError(
                f"reorder needs every in-window chunk; missing {missing}. Evict chunks first to drop them"
            )
        action = REORDER[self.config.reorder]
        steps = self._walk(state, order, lambda i: action, {}, {}, in_order=False)
        plan = WindowPlan("reorder", order, steps=tuple(steps), moved=self._moved(state, order, {}))
        return self._bounded(state, plan)

    def remove(self, state: WindowRecord, refs: Sequence[ChunkRef], op: str) -> WindowPlan:
        gone = set(refs)
        order = tuple(r for r in state.order if r not in gone)
        action = SURVIVORS[self.config.survivors]
        steps = self._walk(state, order, lambda i: action, {}, {})
        plan = WindowPlan(op, order, tuple(refs), steps=tuple(steps), moved=self._moved(state, order, {}))
        return self._bounded(state, plan)

    def recall(self, state: WindowRecord, ref: ChunkRef, at: int | None) -> WindowPlan:
        entry = _known(state, ref)
        if entry.in_window:
            raise ChunkInWindowError(f"{ref} is already in the window; reorder it instead of recalling it")
        self._check_recallable(entry, ref)
        evicted, probes = make_room(self.config, state, entry.chunk.num_tokens, pinned=(ref,))
        if probes:
            placeholder, _ = make_room(self.config, state, entry.chunk.num_tokens, pinned=(ref,), scores={})
            plan = self._recall(state, ref, at, placeholder)
            return self._with_probes(state, plan, probes)
        return self._recall(state, ref, at, evicted)

    def arrange(
        self, state: WindowRecord, items: Sequence[ChunkRef | tuple[Chunk, str | None]]
    ) -> WindowPlan:
        """The window as ``items``, in this order, in one op: an in-window ref stays (moved where
        it stands in ``items``), an evicted one comes back (a recall), new content is admitted,
        and every in-window chunk ``items`` does not name leaves (an evict).

        Why one op: a request that drops, moves, re-sends and adds chunks at once would otherwise
        run an evict, a reorder, recalls and an extend, each re-settling what follows it; as one
        op every chunk is settled once and the whole edit is bounded by one re-prefill from its
        first changed slot.
        """
        order, chunks, recalled = self._arranged(state, items)
        self._check_fits(state, order, chunks)
        named = set(order)
        evicted = tuple(ref for ref in state.order if ref not in named)
        stayed = [ref for ref in order if ref in state.order]
        reordered = stayed != [ref for ref in state.order if ref in named]
        first_new = next((i for i, ref in enumerate(order) if ref in chunks or ref in recalled), len(order))
        survivor, reorder = SURVIVORS[self.config.survivors], REORDER[self.config.reorder]
        follow: PatchAction = "form" if self.config.cascade == "cascade" else "keep"

        def action(i: int) -> PatchAction:
            return reorder if reordered else survivor if i < first_new else follow

        special: dict[ChunkRef, Special] = {
            ref: partial(self._pushed, ref, chunk, tuple(order)) for ref, chunk in chunks.items()
        }
        for ref in recalled:
            special[ref] = partial(self._recalled, state, ref, tuple(order))
        steps = self._walk(state, order, action, special, chunks, in_order=False)
        admitted = tuple(ref for ref in order if ref in chunks or ref in recalled)
        moved = self._moved(state, order, chunks)
        plan = WindowPlan("arrange", tuple(order), evicted, admitted, tuple(steps), dict(chunks), moved)
        return self._bounded(state, plan.changed(recalled=tuple(recalled)))

    def _arranged(
        self, state: WindowRecord, items: Sequence[ChunkRef | tuple[Chunk, str | None]]
    ) -> tuple[list[ChunkRef], dict[ChunkRef, Chunk], list[ChunkRef]]:
        """What ``arrange`` names: the new order, the new content's chunks, the refs recalled."""
        order: list[ChunkRef] = []
        chunks: dict[ChunkRef, Chunk] = {}
        recalled: list[ChunkRef] = []
        for item in items:
            if isinstance(item, ChunkRef):
                entry = _known(state, item)
                if item in order:
                    raise DuplicateChunkError(f"{item} appears twice in arrange; name each chunk once")
                if not entry.in_window:
                    self._check_recallable(entry, item)
                    recalled.append(item)
                order.append(item)
            else:
                chunk, label = item
                ref = state.mint(chunk, label, len(chunks))
                self._check_storable(chunk)
                chunks[ref] = chunk
                order.append(ref)
        return order, chunks, recalled

    def materialize(self, state: WindowRecord) -> WindowPlan:
        """Form every patch that lazy timing deferred, left to right, before a read."""
        order = tuple(state.order)

        def step(ref: ChunkRef) -> Special:
            if state.entries[ref].pending:
                return lambda i, ctx: self.rules.formed(state, ref, i, order, ctx, "patch due (lazy)")
            return lambda i, ctx: Step("rotate", ref, state.entries[ref].state)

        special = {ref: step(ref) for ref in order}
        steps = self._walk(state, order, _no_action, special, {})
        return self._bounded(state, WindowPlan("materialize", order, steps=tuple(steps)))

    # -- the walk -------------------------------------------------------------------------------
    def _recall(
        self, state: WindowRecord, ref: ChunkRef, at: int | None, evicted: Sequence[ChunkRef]
    ) -> WindowPlan:
        entry = state.entries[ref]
        gone = set(evicted)
        survivors = [r for r in state.order if r not in gone]
        index = len(survivors) if at is None else at
        if not 0 <= index <= len(survivors):
            raise WindowError(f"recall at={at} is outside the window's 0..{len(survivors)} slots")
        order = (*survivors[:index], ref, *survivors[index:])
        survivor = SURVIVORS[self.config.survivors]
        follow: PatchAction = "form" if self.config.cascade == "cascade" else "keep"

        def action(i: int) -> PatchAction:
            return survivor if i < index else follow

        special: dict[ChunkRef, Special] = {
            ref: lambda i, ctx: self.rules.recalled(state, ref, i, order, ctx)
        }
        steps = self._walk(state, order, action, special, {ref: entry.chunk}, moved_one=ref)
        moved = self._moved(state, order, {ref: entry.chunk})
        plan = WindowPlan("recall", order, tuple(evicted), (ref,), tuple(steps), moved=moved)
        return self._bounded(state, plan)

    def _admit(
        self,
        state: WindowRecord,
        op: str,
        chunks: Mapping[ChunkRef, Chunk],
        evicted: Sequence[ChunkRef],
        at: ChunkRef | None = None,
        appended: Mapping[ChunkRef, Chunk] | None = None,
    ) -> WindowPlan:
        """New chunks at the right end, or in the slot of ``at`` (which is among ``evicted``),
        with ``appended`` ones at the right end as well."""
        gone, new = set(evicted), tuple(chunks)
        order: list[ChunkRef] = []
        for ref in state.order:
            if ref == at:
                order.extend(new)
            elif ref not in gone:
                order.append(ref)
        if at is None:
            order.extend(new)
        if appended:
            chunks = {**chunks, **appended}
            new = (*new, *appended)
            order.extend(appended)
        survivor = SURVIVORS[self.config.survivors]
        special: dict[ChunkRef, Special] = {
            ref: partial(self._pushed, ref, chunk, tuple(order)) for ref, chunk in chunks.items()
        }
        steps = self._walk(state, order, lambda i: survivor, special, chunks)
        moved = self._moved(state, order, chunks)
        plan = WindowPlan(op, tuple(order), tuple(evicted), new, tuple(steps), dict(chunks), moved)
        return self._bounded(state, plan)

    def _pushed(self, ref: ChunkRef, chunk: Chunk, order: Sequence[ChunkRef], i: int, ctx: Context) -> Step:
        return self.rules.pushed(ref, chunk, i, order, ctx)

    def _recalled(
        self, state: WindowRecord, ref: ChunkRef, order: Sequence[ChunkRef], i: int, ctx: Context
    ) -> Step:
        return self.rules.recalled(state, ref, i, order, ctx)

    def _walk(
        self,
        state: WindowRecord,
        order: Sequence[ChunkRef],
        action_at: Callable[[int], PatchAction],
        special: Mapping[ChunkRef, Special],
        chunks: Mapping[ChunkRef, Chunk],
        *,
        in_order: bool = True,
        moved_one: ChunkRef | None = None,
    ) -> list[Step]:
        """One step per chunk of ``order`` (and a ``form_canonical`` before each admitted one).

        ``in_order``: the op leaves the chunks' relative order as it was except for ``moved_one`` (push,
        slide, evict and recall do), so a chunk can only come to encode a chunk to its right by
        encoding that one; a reorder (``False``) checks every antecedent.
        """
        before: LeftContexts = cache(lambda: self._left_contexts(state))
        index_of = {ref: i for i, ref in enumerate(order)}
        causal = _causality(state, index_of, in_order, moved_one)
        same = _same_content(state, order)
        force: set[ChunkRef] = set()
        while True:
            steps: list[Step] = []
            ctx, deferred, must_form = self.root, [], set()
            previous: Step | None = None
            group: list[Step] = []  # the in-window formations sharing the current forward
            for i, ref in enumerate(order):
                taken = self._taken(state, ref, i, order, ctx, before) if i < same else None
                if taken is not None:
                    step = taken
                elif ref in special:
                    step = special[ref](i, ctx)
                elif ref in force:
                    step = self.rules.formed(
                        state, ref, i, order, ctx, "formed first: a chunk to its right is patched over it"
                    )
                else:
                    step = self.rules.decide(state, ref, i, order, causal, ctx, before, action_at(i))
                step = self.rules.across_gap(self.rules.in_run(step, previous), group)
                if step.kind == "form_patch":
                    group = [] if step.off_window else [*group, step] if step.in_run else [step]
                if step.needs_canonical:
                    steps.append(self.rules.form_canonical(ref, chunks.get(ref) or state.entries[ref].chunk))
                if step.kind == "defer":
                    deferred.append(ref)
                elif (
                    step.kind in ("form_patch", "apply_patch")
                    and not step.off_window
                    and step.state.kind == "patched"
                ):
                    must_form.update(deferred)
                steps.append(step)
                previous = step
                ctx = ctx.extend(step.state)
            if not must_form - force:
                return steps
            force |= must_form

    # -- never costlier than a prefix cache ------------------------------------------------------
    def _bounded(self, state: WindowRecord, plan: WindowPlan) -> WindowPlan:
        """``plan`` or re-prefilling, whichever prefills fewer tokens (`PrefixBound`)."""
        return self.bound.bounded(state, plan)

    def refill(self, state: WindowRecord, start: int, why: str, end: int | None = None) -> WindowPlan:
        """Re-prefill the window's chunks from index ``start`` on (to ``end``, else to the last):
        how a drift budget is kept (`PrefixBound.refill`)."""
        return self.bound.refill(state, start, why, end)

    def _taken(
        self,
        state: WindowRecord,
        ref: ChunkRef,
        i: int,
        order: Sequence[ChunkRef],
        ctx: Context,
        before: LeftContexts,
    ) -> Step | None:
        """Another chunk of the same content held slot ``i`` before the op, behind the same
        content: ``ref`` takes its KV as it was (what a prefix cache reuses), where that KV
        still encodes only chunks to the left (none this op brings back to the right)."""
        holder = state.order[i]
        entry = state.entries[holder]
        if holder == ref or entry.pending or before().get(holder) != ctx.digest:
            return None
        old_index = {r: k for k, r in enumerate(state.order)}
        antecedents = []
        for source in state.antecedents_of(holder):
            if source in old_index and old_index[source] < i:
                antecedents.append(order[old_index[source]])
            elif source in order:
                return None  # it encodes a chunk brought back to its right (now or before)
            else:
                antecedents.append(source)
        detail = "same content as the chunk that held this slot: takes its KV"
        return Step("rotate", ref, entry.state, tuple(antecedents), source=holder, detail=detail)

    def _left_contexts(self, state: WindowRecord) -> dict[ChunkRef, str]:
        """Each in-window chunk's left context before this op, as a digest (one pass)."""
        out, ctx = {}, self.root
        for ref in state.order:
            out[ref] = ctx.digest
            ctx = ctx.extend(state.entries[ref].state)
        return out

    def _moved(
        self, state: WindowRecord, order: Sequence[ChunkRef], chunks: Mapping[ChunkRef, Chunk]
    ) -> frozenset[ChunkRef]:
        """The chunks whose start changes from the current order to ``order``."""
        before, position = {}, 0
        for ref in state.order:
            before[ref] = position
            position += state.entries[ref].chunk.advance
        moved, position = set(), 0
        for ref in order:
            if before.get(ref) != position:
                moved.add(ref)
            position += (chunks[ref] if ref in chunks else state.entries[ref].chunk).advance
        return frozenset(moved)

    def _with_probes(self, state: WindowRecord, plan: WindowPlan, probes: tuple[ChunkRef, ...]) -> WindowPlan:
        """The plan as a dry run shows it (FIFO's outcome), with the probes that decide the real one."""
        assert state.last_answer is not None
        query = state.last_answer.query
        tokens = self.inputs.query_tokens(query)
        return plan.changed(evicted=(), probes=probes, probe_query=query, probe_tokens=tokens)

    def _check_recallable(self, entry: Entry, ref: ChunkRef) -> None:
        """An evicted chunk can come back unless it lost both its pixels and its stored KV."""
        held = [entry.state.stored_as, *([entry.original.state.stored_as] if entry.original else [])]
        if not any(can_form(entry.chunk, self.view, digest) for digest in held):
            raise ChunkLostError(
                f"{ref} released its pixels at eviction and the store no longer holds its canonical or "
                "vision output; push the content again (a disk tier or evicted_pixels='retain' prevents this)"
            )
        self._check_storable(entry.chunk)

    def _check_fits(
        self, state: WindowRecord, order: Sequence[ChunkRef], chunks: Mapping[ChunkRef, Chunk]
    ) -> None:
        """An arrangement the window's capacity cannot hold is refused before anything changes."""
        cap_chunks, cap_tokens = self.config.capacity_chunks, self.config.capacity_tokens
        tokens = sum((chunks[r] if r in chunks else state.entries[r].chunk).num_tokens for r in order)
        if cap_chunks is not None and len(order) > cap_chunks:
            raise CapacityError(
                f"arrange names {len(order)} chunks; capacity_chunks is {cap_chunks}. Name fewer or raise it"
            )
        if cap_tokens is not None and tokens > cap_tokens:
            raise CapacityError(
                f"arrange names {tokens} tokens; capacity_tokens is {cap_tokens}. Name fewer or raise it"
            )

    def _check_storable(self, chunk: Chunk) -> None:
        """A canonical that no store limit can hold fails the op before anything changes."""
        nbytes = chunk.num_tokens * self.inputs.kv_bytes_per_token
        if not self.view.has_canonical(chunk.key) and not self.view.fits(nbytes):
            raise StoreLimitError(
                f"the canonical of a {chunk.num_tokens}-token chunk takes {nbytes} bytes, more than the "
                "store's limit; raise memory_limit (and disk_limit) above the largest chunk"
            )


def _no_action(i: int) -> PatchAction:
    return "keep"


def _causality(
    state: WindowRecord, index_of: Mapping[ChunkRef, int], in_order: bool, moved: ChunkRef | None
) -> Callable[[ChunkRef, int], bool]:
    """Whether a chunk at index ``i`` encodes nothing now at or right of it but what was already.

    Before every op, in-window edges point left to right but where a chunk stood when one it had
    absorbed came back to its right (`Rules.stands`: the edge names that one's state then). An
    op that leaves the other chunks' relative order can only bring an antecedent to a chunk's
    right through the one chunk it moves; a reorder checks all.
    """
    encodes = state.graph._pred  # each chunk's in-edge dict (networkx's own; a view per call cost more)

    def one_moved(ref: ChunkRef, i: int) -> bool:
        return moved is None or moved not in encodes[ref] or index_of[moved] < i

    if in_order:
        return one_moved
    was = {ref: k for k, ref in enumerate(state.order)}

    def any_order(ref: ChunkRef, i: int) -> bool:
        here = was.get(ref, len(was))
        return all(index_of.get(p, -1) < i or was.get(p, -1) > here for p in encodes[ref])

    return any_order


def _same_content(state: WindowRecord, order: Sequence[ChunkRef]) -> int:
    """How many leading slots hold the same content (chunk keys) before and after the op."""
    same = 0
    for old, new in zip(state.order, order, strict=False):
        if old.key != new.key:
            break
        same += 1
    return same


def _known(state: WindowRecord, ref: ChunkRef) -> Entry:
    if not isinstance(ref, ChunkRef):
        raise UnknownChunkError(f"expected a ChunkRef from this window, got {type(ref).__name__}")
    entry = state.entries.get(ref)
    if entry is None:
        raise UnknownChunkError(
            f"{ref} does not belong to this window (another window's or branch's ref, or forgotten)"
        )
    return entry


def _in_window(state: WindowRecord, ref: ChunkRef) -> ChunkRef:
    if not _known(state, ref).in_window:
        raise UnknownChunkError(f"{ref} is not in the window (evicted); recall it first")
    return ref
