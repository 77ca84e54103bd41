"""Planning window operations: which cache edit each chunk needs, from states and a store view.

Why pure: a planner reads the window's state and a read-only view of the store and returns a
`WindowPlan`; it never runs the model, never writes, never counts a store hit. So
``window.plan(...)`` is a dry run by construction and every rule below can be unit-tested.

Every operation asks the same question per chunk, left to right over the *new* order, while
the planned states of the chunks to its left are chained into a `Context`: does its KV still
encode exactly what is now to its left?

1. its state's context is the planned left context → **rotate** only (relocation is exact);
2. first in the window → **revert** to the canonical (exact there);
3. its left context is what it was before this op and it encodes nothing now at or right of
   it → **rotate**: the op did not touch what it depends on;
4. same antecedent *set*, other order, orbit patches on, an orbit patch stored → **apply** it;
5. a patch stored for the state it would have over the planned left context → **apply** it;
6. otherwise the op's policy: **form** a patch (one conditioned forward), **keep** the old one
   (only while causal), **revert** to the canonical, or **defer** (lazy).

Lookups in 4-5 go by chained state, so a patch formed over antecedents that encode something
else (a survivor of a slide, an approximate patch, another window's history) is never found
where exact antecedents stand. A lazily deferred chunk is formed first whenever a chunk to its
right would be patched over it, so nothing is ever conditioned on a placeholder.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.config import WindowConfig
from kamera_agent.core.identity import ChunkState, Context, StateRank, effective_rank, orbit_key
from kamera_agent.core.staging import StoreView, can_encode
from kamera_agent.errors import (
    CapacityError,
    ChunkInWindowError,
    ChunkLostError,
    DuplicateChunkError,
    StoreBudgetError,
    UnknownChunkError,
    WindowError,
)
from kamera_agent.policies import EVICTION, PATCH_TIMING, REORDER, SURVIVORS, EvictionContext, PatchAction
from kamera_agent.results import EditKind
from kamera_agent.window.plan import Step, WindowPlan
from kamera_agent.window.state import ChunkRef, Entry, WindowState

__all__ = ["PlanInputs", "Planner"]

Special = Callable[[int, Context], Step]
"""A step decided by the op itself (the pushed chunk, the recalled one) at index ``i`` over ``ctx``."""


@dataclass(frozen=True)
class PlanInputs:
    """What planning reads besides the window state, all of it read-only.

    Attributes:
        config: the window's settings.
        view: presence of store entries and stored patches' states (no loads, no counts).
        root: the context every window of this model and anchor starts behind.
        features: the widest KV slot (heads · dim): a rank at or above it is lossless.
        kv_bytes_per_token: bytes of one token's canonical, for budget checks.
        anchor_ready: the anchor's KV is computed (else the first forward also runs it).
        query_tokens: how many tokens a query has (probe edits' cost).
    """

    config: WindowConfig
    view: StoreView
    root: Context
    features: int
    kv_bytes_per_token: int
    anchor_ready: bool = True
    query_tokens: Callable[[str], int] = lambda query: 0


class Planner:
    """Builds `WindowPlan` objects for push, reorder, slide/evict, recall and lazy materialization."""

    def __init__(self, inputs: PlanInputs) -> None:
        self.inputs, self.config, self.view, self.root = inputs, inputs.config, inputs.view, inputs.root
        self.rank = inputs.config.effective_rank

    # -- operations ---------------------------------------------------------------------------
    def push(self, state: WindowState, chunk: Chunk, label: str | None) -> WindowPlan:
        ref = state.mint(chunk, label)
        self._check_storable(chunk)
        evicted, probes = self._make_room(state, chunk.num_tokens, keep=())
        if probes:  # a dry run shows the FIFO outcome; the real one is planned after the probes
            placeholder, _ = self._make_room(state, chunk.num_tokens, keep=(), scores={})
            plan = self._push(state, ref, chunk, placeholder)
            return self._with_probes(state, plan, probes)
        return self._push(state, ref, chunk, evicted)

    def reorder(self, state: WindowState, refs: Sequence[ChunkRef]) -> WindowPlan:
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
        steps = self._walk(state, order, lambda i: action, {}, {}, keeps_order=False)
        return WindowPlan("reorder", order, steps=tuple(steps), moved=self._moved(state, order, {}))

    def remove(self, state: WindowState, refs: Sequence[ChunkRef], op: str) -> WindowPlan:
        gone = set(refs)
        order = tuple(r for r in state.order if r not in gone)
        action = SURVIVORS[self.config.survivors]
        steps = self._walk(state, order, lambda i: action, {}, {})
        return WindowPlan(op, order, tuple(refs), steps=tuple(steps), moved=self._moved(state, order, {}))

    def recall(self, state: WindowState, ref: ChunkRef, at: int | None) -> WindowPlan:
        entry = _known(state, ref)
        if entry.in_window:
            raise ChunkInWindowError(f"{ref} is already in the window; reorder it instead of recalling it")
        if not can_encode(entry.chunk, self.view):
            raise ChunkLostError(
                f"{ref} released its pixels at eviction and the store no longer holds its canonical or "
                "vision output; push the content again (a disk tier or evicted_pixels='keep' prevents this)"
            )
        self._check_storable(entry.chunk)
        evicted, probes = self._make_room(state, entry.chunk.num_tokens, keep=(ref,))
        if probes:
            placeholder, _ = self._make_room(state, entry.chunk.num_tokens, keep=(ref,), scores={})
            plan = self._recall(state, ref, at, placeholder)
            return self._with_probes(state, plan, probes)
        return self._recall(state, ref, at, evicted)

    def materialize(self, state: WindowState) -> WindowPlan:
        """Form every patch that lazy timing deferred, left to right, before a read."""
        order = tuple(state.order)

        def step(ref: ChunkRef) -> Special:
            if state.entries[ref].pending:
                return lambda i, ctx: self._formed(state, ref, i, order, ctx, "patch due (lazy)")
            return lambda i, ctx: Step("rotate", ref, state.entries[ref].state)

        special = {ref: step(ref) for ref in order}
        return WindowPlan(
            "materialize", order, steps=tuple(self._walk(state, order, _no_action, special, {}))
        )

    # -- the walk -------------------------------------------------------------------------------
    def _recall(
        self, state: WindowState, ref: ChunkRef, at: int | None, evicted: Sequence[ChunkRef]
    ) -> WindowPlan:
        entry = state.entries[ref]
        gone = set(evicted)
        survivors = [r for r in state.order if r not in gone]
        index = len(survivors) if at is None else at
        if not 0 <= index <= len(survivors):
            raise WindowError(f"recall at={at} is outside the window's 0..{len(survivors)} slots")
        order = (*survivors[:index], ref, *survivors[index:])
        keep = SURVIVORS[self.config.survivors]
        follow: PatchAction = "form" if self.config.cascade == "cascade" else "keep"

        def action(i: int) -> PatchAction:
            return keep if i < index else follow

        special: dict[ChunkRef, Special] = {ref: lambda i, ctx: self._recalled(state, ref, i, order, ctx)}
        steps = self._walk(state, order, action, special, {ref: entry.chunk}, moved_one=ref)
        moved = self._moved(state, order, {ref: entry.chunk})
        return WindowPlan("recall", order, tuple(evicted), (ref,), tuple(steps), moved=moved)

    def _push(
        self, state: WindowState, ref: ChunkRef, chunk: Chunk, evicted: Sequence[ChunkRef]
    ) -> WindowPlan:
        gone = set(evicted)
        order = (*(r for r in state.order if r not in gone), ref)
        keep = SURVIVORS[self.config.survivors]
        special: dict[ChunkRef, Special] = {ref: lambda i, ctx: self._pushed(ref, chunk, i, order, ctx)}
        steps = self._walk(state, order, lambda i: keep, special, {ref: chunk})
        moved = self._moved(state, order, {ref: chunk})
        return WindowPlan("push", order, tuple(evicted), (ref,), tuple(steps), {ref: chunk}, moved)

    def _walk(
        self,
        state: WindowState,
        order: Sequence[ChunkRef],
        action_at: Callable[[int], PatchAction],
        special: Mapping[ChunkRef, Special],
        chunks: Mapping[ChunkRef, Chunk],
        *,
        keeps_order: bool = True,
        moved_one: ChunkRef | None = None,
    ) -> list[Step]:
        """One step per chunk of ``order`` (and an ``encode`` before each admitted one).

        ``keeps_order``: the op keeps the chunks' relative order except for ``moved_one`` (push,
        slide, evict and recall do), so a chunk can only come to encode a chunk to its right by
        encoding that one; a reorder (``False``) checks every antecedent.
        """
        before = _Once(lambda: self._left_contexts(state))
        index_of = {ref: i for i, ref in enumerate(order)}
        causal = _causality(state, index_of, keeps_order, moved_one)
        force: set[ChunkRef] = set()
        while True:
            steps: list[Step] = []
            ctx, deferred, must_form = self.root, [], set()
            previous: Step | None = None
            for i, ref in enumerate(order):
                if ref in chunks:
                    steps.append(self._encode(ref, chunks[ref]))
                if ref in special:
                    step = special[ref](i, ctx)
                elif ref in force:
                    step = self._formed(
                        state, ref, i, order, ctx, "formed first: a chunk to its right is patched over it"
                    )
                else:
                    step = self._decide(state, ref, i, order, causal, ctx, before, action_at(i))
                step = self._in_run(step, previous)
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

    def _decide(
        self,
        state: WindowState,
        ref: ChunkRef,
        i: int,
        order: Sequence[ChunkRef],
        causal: Callable[[ChunkRef, int], bool],
        ctx: Context,
        before: _Once,
        action: PatchAction,
    ) -> Step:
        """The edit an in-window chunk needs at index ``i`` behind ``ctx`` (the module's rules)."""
        entry = state.entries[ref]
        current = entry.state
        if self.rank == 0:
            kind: EditKind = "rotate" if current.kind == "canonical" else "revert"
            return Step(kind, ref, self._canonical(ref), detail="blind reuse: relocation only")
        if entry.pending:
            return Step("defer", ref, self._canonical(ref), detail="patch still due (lazy)")
        if current.kind != "orbit" and current.context.digest == ctx.digest:
            # The chunks to its left hold exactly the states it encodes (with repeated content,
            # maybe other refs than before): its edges follow them.
            return Step(
                "rotate", ref, current, tuple(order[:i]), detail="antecedents unchanged: relocation only"
            )
        if i == 0:
            return Step(
                "revert", ref, self._canonical(ref), detail="first in the window: the canonical is exact"
            )
        if before().get(ref) == ctx.digest and causal(ref, i):
            return Step("rotate", ref, current, detail="this op left its left context as it was")
        rank, n = self._rank_of(entry.chunk), entry.chunk.num_tokens
        same_set = current.keyset == ctx.keyset and (current.kind == "orbit" or current.context.length == i)
        if self.config.orbit and current.kind != "canonical" and same_set:
            address = orbit_key(ref.key, rank, self.root, ctx)
            orbit = self._stored_orbit(ref.key, rank, address, ctx.keyset)
            if orbit is not None:
                return Step(
                    "apply_patch",
                    ref,
                    orbit,
                    tuple(order[:i]),
                    address,
                    detail="same antecedent set: orbit patch",
                )
        target = ChunkState.patched(ref.key, rank, ctx)
        if self.view.has_patch(ref.key, target.digest):
            return Step(
                "apply_patch",
                ref,
                target,
                tuple(order[:i]),
                target.digest,
                detail="stored patch for these antecedents",
            )
        if action == "keep":
            if causal(ref, i):
                return Step("rotate", ref, current, detail="keeps its patch (policy: keep)")
            return self._form(ref, target, order[:i], "its patch encodes a chunk now to its right", n)
        if action == "revert":
            return Step("revert", ref, self._canonical(ref), detail="no stored patch fits (policy: revert)")
        if action == "defer":
            return Step("defer", ref, self._canonical(ref), detail="patch formed before the next read (lazy)")
        return self._form(ref, target, order[:i], "conditioned forward over its new left context", n)

    def _pushed(self, ref: ChunkRef, chunk: Chunk, i: int, order: Sequence[ChunkRef], ctx: Context) -> Step:
        if self.rank == 0:
            return Step("rotate", ref, self._canonical(ref), detail="blind reuse")
        if i == 0:
            return Step("rotate", ref, self._canonical(ref), detail="canonical is exact here")
        target = ChunkState.patched(ref.key, self._rank_of(chunk), ctx)
        left = tuple(order[:i])
        if self.view.has_patch(ref.key, target.digest):
            return Step(
                "apply_patch", ref, target, left, target.digest, detail="stored patch for this left context"
            )
        action = PATCH_TIMING[self.config.patch_mode]
        if action == "form":
            return self._form(ref, target, left, "conditioned on its left context", chunk.num_tokens)
        if action == "defer":
            return Step("defer", ref, self._canonical(ref), detail="patch timing: lazy")
        return Step("revert", ref, self._canonical(ref), detail=f"patch timing: {self.config.patch_mode}")

    def _recalled(
        self, state: WindowState, ref: ChunkRef, i: int, order: Sequence[ChunkRef], ctx: Context
    ) -> Step:
        entry = state.entries[ref]
        if self.rank == 0:
            return Step("revert", ref, self._canonical(ref), detail="blind reuse")
        home, why = entry.home, "patch on the chunks now to its left"
        if self.config.recall_context == "original" and home is not None:
            if home.state.kind == "canonical":
                return Step(
                    "revert",
                    ref,
                    self._canonical(ref),
                    detail="its context was empty: served as its canonical",
                )
            later = set(order[i + 1 :])
            if any(r in later for r in home.refs):
                why = "its earlier context is now to its right: patch on its new left"
            elif self.view.has_patch(ref.key, home.state.digest):
                detail = "stored patch on its original earlier context"
                return Step("apply_patch", ref, home.state, home.refs, home.state.digest, detail=detail)
            else:
                cost = self._rebuild_cost(state, home.state.context)
                if cost is not None:
                    forwards, tokens = cost[0] + 1, cost[1] + entry.chunk.num_tokens
                    detail = "patch on its original earlier context"
                    return Step(
                        "form_patch",
                        ref,
                        home.state,
                        home.refs,
                        off_window=True,
                        forwards=forwards,
                        tokens=tokens,
                        detail=detail,
                    )
                why = "its original context can no longer be rebuilt: patch on the chunks now to its left"
        if i == 0:
            return Step(
                "revert", ref, self._canonical(ref), detail="first in the window: the canonical is exact"
            )
        target = ChunkState.patched(ref.key, self._rank_of(entry.chunk), ctx)
        if self.view.has_patch(ref.key, target.digest):
            return Step("apply_patch", ref, target, tuple(order[:i]), target.digest, detail=f"stored {why}")
        return self._form(ref, target, order[:i], why, entry.chunk.num_tokens)

    def _formed(
        self, state: WindowState, ref: ChunkRef, i: int, order: Sequence[ChunkRef], ctx: Context, why: str
    ) -> Step:
        """A pending chunk's patch over its left context, now (or the canonical at the front)."""
        if i == 0 or self.rank == 0:
            return Step(
                "revert", ref, self._canonical(ref), detail=f"{why}: first in the window, the canonical"
            )
        target = ChunkState.patched(ref.key, self._rank_of(state.entries[ref].chunk), ctx)
        if self.view.has_patch(ref.key, target.digest):
            return Step("apply_patch", ref, target, tuple(order[:i]), target.digest, detail=f"{why}: stored")
        return self._form(ref, target, order[:i], why, state.entries[ref].chunk.num_tokens)

    # -- pieces -------------------------------------------------------------------------------
    def _form(
        self, ref: ChunkRef, target: ChunkState, left: Sequence[ChunkRef], why: str, tokens: int
    ) -> Step:
        return Step("form_patch", ref, target, tuple(left), forwards=1, tokens=tokens, detail=why)

    def _in_run(self, step: Step, previous: Step | None) -> Step:
        """A formation right after another shares its forward, and records what that forward gives.

        One forward over consecutive chunks conditions each on the *exact* KV of the chunks
        before it in the run, not on their rank-m patched KV: so the joining chunk's state is
        its patch over the previous member as that forward computed it (its full-rank state).
        With lossless ranks the two are the same state.
        """
        if step.kind != "form_patch" or step.off_window:
            return step
        if previous is None or previous.kind != "form_patch" or previous.off_window:
            return step
        formed_over = previous.state.context  # what the previous member was conditioned on
        exact_previous = ChunkState.patched(previous.ref.key, "full", formed_over)
        context = formed_over.extend(exact_previous)
        # The step was just built for this walk: marking it in place is safe.
        step.state = ChunkState.patched(step.ref.key, step.state.rank, context)
        step.in_run, step.forwards = True, 0
        return step

    def _encode(self, ref: ChunkRef, chunk: Chunk) -> Step:
        stored = self.view.has_canonical(chunk.key)
        forwards = 0 if stored else 1 + int(not self.inputs.anchor_ready)
        if stored:
            detail = "canonical from the store (no forward)"
        elif chunk.has_vision:
            vision = chunk.vision_key is not None and self.view.has_vision(chunk.vision_key)
            detail = "prefill behind the anchor" + (" (vision output from the store)" if vision else "")
        else:
            detail = "prefill behind the anchor"
        return Step(
            "encode",
            ref,
            self._canonical(ref),
            forwards=forwards,
            tokens=chunk.num_tokens * (not stored),
            detail=detail,
        )

    def _canonical(self, ref: ChunkRef) -> ChunkState:
        return ChunkState.canonical(ref.key, self.root)

    def _rank_of(self, chunk: Chunk) -> StateRank:
        rank = self.rank
        return effective_rank(rank, chunk.num_tokens, self.inputs.features) if rank != 0 else 0

    def _stored_orbit(
        self, chunk_key: str, rank: StateRank, address: str, keyset: int = 0
    ) -> ChunkState | None:
        info = self.view.patch_info(chunk_key, address)
        if info is None:
            return None
        members = tuple(json.loads(info[1].get("members", "[]")))
        orbit = ChunkState.orbit(chunk_key, rank, self.root, address, members, keyset)
        return orbit if orbit.digest == info[0] else None

    def _rebuild_cost(self, state: WindowState, context: Context) -> tuple[int, int] | None:
        """Forwards and tokens to rebuild every state of ``context`` from the store; ``None`` if one
        cannot be (its chunk is forgotten, an orbit changed, an image lost its pixels and KV)."""
        chunks = {entry.chunk.key: entry.chunk for entry in state.entries.values()}
        memo: dict[str, tuple[int, int] | None] = {}

        def cost(s: ChunkState) -> tuple[int, int] | None:
            if s.digest in memo:
                return memo[s.digest]
            memo[s.digest] = None  # a cycle cannot occur; this only guards re-entry
            chunk = chunks.get(s.chunk_key)
            result: tuple[int, int] | None = None
            if chunk is not None and can_encode(chunk, self.view):
                base = (0, 0) if self.view.has_canonical(s.chunk_key) else (1, chunk.num_tokens)
                if s.kind == "canonical" or (
                    s.kind == "patched" and self.view.has_patch(s.chunk_key, s.digest)
                ):
                    result = base
                elif s.kind == "patched":
                    below = [cost(a) for a in s.context.states()]
                    if all(b is not None for b in below):
                        f = base[0] + 1 + sum(b[0] for b in below if b is not None)
                        t = base[1] + chunk.num_tokens + sum(b[1] for b in below if b is not None)
                        result = (f, t)
                elif self._stored_orbit(s.chunk_key, s.rank, s.address, s.keyset) == s:
                    result = base
            memo[s.digest] = result
            return result

        total = [cost(s) for s in context.states()]
        if any(t is None for t in total):
            return None
        return sum(t[0] for t in total if t), sum(t[1] for t in total if t)

    def _left_contexts(self, state: WindowState) -> dict[ChunkRef, str]:
        """Each in-window chunk's left context before this op, as a digest (one pass)."""
        out, ctx = {}, self.root
        for ref in state.order:
            out[ref] = ctx.digest
            ctx = ctx.extend(state.entries[ref].state)
        return out

    def _moved(
        self, state: WindowState, order: Sequence[ChunkRef], chunks: Mapping[ChunkRef, Chunk]
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

    def _make_room(
        self,
        state: WindowState,
        tokens: int,
        keep: Sequence[ChunkRef],
        scores: Mapping[ChunkRef, float] | None = None,
    ) -> tuple[list[ChunkRef], tuple[ChunkRef, ...]]:
        """Chunks to evict so that a chunk of ``tokens`` fits, or the chunks to probe first."""
        cap_chunks, cap_tokens = self.config.capacity_chunks, self.config.capacity_tokens
        if cap_tokens is not None and tokens > cap_tokens:
            raise CapacityError(
                f"a chunk of {tokens} tokens can never fit capacity_tokens={cap_tokens}; raise the capacity"
            )
        order = [r for r in state.order if r not in set(keep)]
        used = sum(state.entries[r].chunk.num_tokens for r in order)

        def over(evicted: int, used: int) -> bool:
            chunks = cap_chunks is not None and len(order) - evicted + 1 > cap_chunks
            return chunks or (cap_tokens is not None and used + tokens > cap_tokens)

        if not over(0, used):
            return [], ()
        policy = EVICTION[self.config.eviction]
        last = state.last_answer
        if policy.probes and last is not None and scores is None:
            cached = state.scores
            if cached is None or (cached.query, cached.tick) != (last.query, state.tick):
                return [], tuple(order)
            scores = cached.kl
        last_used = {r: state.entries[r].last_used for r in order}
        evicted: list[ChunkRef] = []
        for candidate in policy.rank(EvictionContext(order, last_used, scores or None)):
            if not over(len(evicted), used):
                break
            evicted.append(candidate)
            used -= state.entries[candidate].chunk.num_tokens
        return evicted, ()

    def _with_probes(self, state: WindowState, plan: WindowPlan, probes: tuple[ChunkRef, ...]) -> WindowPlan:
        """The plan as a dry run shows it (FIFO's outcome), with the probes that decide the real one."""
        assert state.last_answer is not None
        query = state.last_answer.query
        tokens = self.inputs.query_tokens(query)
        return replace(plan, evicted=(), probes=probes, probe_query=query, probe_tokens=tokens)

    def _check_storable(self, chunk: Chunk) -> None:
        """A canonical that no budget can hold fails the op before anything changes."""
        nbytes = chunk.num_tokens * self.inputs.kv_bytes_per_token
        if not self.view.has_canonical(chunk.key) and not self.view.fits(nbytes):
            raise StoreBudgetError(
                f"the canonical of a {chunk.num_tokens}-token chunk takes {nbytes} bytes, more than the "
                "store's budget; raise memory_budget (and disk_budget) above the largest chunk"
            )


def _no_action(i: int) -> PatchAction:
    return "keep"


class _Once:
    """A value computed the first time it is asked for (the pre-op left contexts: only some
    chunks' rules need them)."""

    def __init__(self, make: Callable[[], dict[ChunkRef, str]]) -> None:
        self._make = make
        self._value: dict[ChunkRef, str] | None = None

    def __call__(self) -> dict[ChunkRef, str]:
        if self._value is None:
            self._value = self._make()
        return self._value


def _causality(
    state: WindowState, index_of: Mapping[ChunkRef, int], keeps_order: bool, moved: ChunkRef | None
) -> Callable[[ChunkRef, int], bool]:
    """Whether a chunk at index ``i`` encodes nothing now at or right of it.

    Before every op, in-window edges point left to right. An op that keeps the other chunks'
    relative order can only break that through the one chunk it moves; a reorder checks all.
    """
    graph = state.graph

    def any_order(ref: ChunkRef, i: int) -> bool:
        return all(index_of.get(p, -1) < i for p in graph.pred[ref])

    def one_moved(ref: ChunkRef, i: int) -> bool:
        return moved is None or moved not in graph.pred[ref] or index_of[moved] < i

    return one_moved if keeps_order else any_order


def _known(state: WindowState, ref: ChunkRef) -> Entry:
    if not isinstance(ref, ChunkRef):
        raise UnknownChunkError(f"expected a ChunkRef from this window, got {type(ref).__name__}")
    entry = state.entries.get(ref)
    if entry is None:
        raise UnknownChunkError(
            f"{ref} does not belong to this window (another window's or branch's ref, or forgotten)"
        )
    return entry


def _in_window(state: WindowState, ref: ChunkRef) -> ChunkRef:
    if not _known(state, ref).in_window:
        raise UnknownChunkError(f"{ref} is not in the window (evicted); recall it first")
    return ref
