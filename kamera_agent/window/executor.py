"""Executing a window plan as cache edits, placing chunks, and answering over the window.

Why separate from planning: the planner decides from states and a store view; the executor
does what the plan says (place, apply a stored patch, form one with a conditioned forward,
revert, defer) inside one `Txn`, so everything it stores is staged until the op succeeds. The
window restores its state snapshot when anything fails. A stored patch the plan counted on but
that has left the store since is formed instead (its state is the same: a state names what the
KV encodes, not where it came from); an orbit patch that changed under the op raises
`StaleLookup`, and the window plans again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.config import WindowConfig
from kamera_agent.core import Patch
from kamera_agent.core.identity import ChunkState, Context, effective_rank
from kamera_agent.core.kv_core import KVCore, StaleLookup, Txn
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.results import Answer
from kamera_agent.window.plan import Step, WindowPlan, canonical_leads_run, serves_canonical_first
from kamera_agent.window.state import Assembled, ChunkRef, Entry, OriginalContext, WindowState

__all__ = ["Executor", "StaleLookup"]

Piece = tuple[tuple[object, ...], int]
"""What one stretch of an assembled cache holds (the anchor, or a chunk at its start in its
state) and how many cache slots it takes."""


class Executor:
    """Applies plans to one window state inside one transaction; places chunks; decodes."""

    def __init__(self, state: WindowState, core: KVCore, txn: Txn, config: WindowConfig) -> None:
        self.state, self.core, self.txn, self.config = state, core, txn, config
        self.layout = core.backend.layout
        self._starts: dict[ChunkRef, int] = {}
        self._slots: dict[ChunkRef, int] = {}
        self._free: dict[str, tuple[ChunkKV, Patch | None]] = {}
        self._full: dict[str, ChunkKV] = {}
        self._by_key: dict[str, Chunk] | None = None
        self._moved: frozenset[ChunkRef] = frozenset()
        self._placed: dict[tuple[ChunkRef, int, str], ChunkKV] = {}
        self._held: dict[ChunkRef, tuple[ChunkState, Patch | None, ChunkKV | None]] = {}
        self._order_changed()

    # -- running a plan -------------------------------------------------------------------------
    def run(self, plan: WindowPlan) -> None:
        """Apply ``plan``: evictions, admissions, the new order, then every step left to right."""
        state = self.state
        if _changes(state, plan):
            state.tick += 1
        sources = {step.source for step in plan.steps if step.source is not None}
        held = [(ref, state.entries[ref]) for ref in sources if ref in state.entries]
        self._held = {ref: (entry.state, entry.patch, entry.full) for ref, entry in held}
        # and what each such holder's KV encodes, edge by edge, before any step rewrites its edges
        self._held_edges = {r: _recorded_states(state, r) for r in self._held}
        for ref in plan.evicted:
            entry = state.entries[ref]
            entry.in_window, entry.patch, entry.full, entry.evicted_at = False, None, None, state.tick
        for ref in plan.admitted:
            if ref not in state.entries:
                state.add(ref, Entry(plan.chunks[ref], ChunkState.canonical(ref.key, self.core.root)))
            entry = state.entries[ref]
            entry.in_window, entry.last_used = True, state.tick
        state.order = list(plan.order)
        self._order_changed()
        if plan.op == "reorder":
            for ref in plan.order:
                state.entries[ref].last_used = state.tick
        steps, index, self._moved = list(plan.steps), 0, plan.moved
        while index < len(steps):
            step = steps[index]
            if self._leads_a_run(steps, index):
                run, after = self._collect_run(steps, index + 2)
                if [self._slot(s.ref) for s in run] == list(range(1, len(run) + 1)):
                    self._form_in_window(run, lead=steps[index + 1])
                else:  # members with placed chunks between: the canonical on its own
                    self._apply(steps[index])
                    self._apply(steps[index + 1])
                    self._form_in_window(run)
                index = after
            elif step.kind == "form_patch" and not step.off_window:
                run, index = self._collect_run(steps, index)
                self._form_in_window(run)
            elif self._leads_alone(steps, index):
                self._form_in_window([], lead=steps[index + 1])
                index += 2
            else:
                self._apply(step)
                index += 1

    def _leads_a_run(self, steps: Sequence[Step], index: int) -> bool:
        """The steps at ``index`` serve the window's first chunk as its canonical, which the store
        does not hold, and form the next over it (`canonical_leads_run`): one forward from the
        first slot computes both, where forming the canonical first runs a forward of its own."""
        return canonical_leads_run(steps, index, self.state.order) and self._unstored(steps[index].ref)

    def _leads_alone(self, steps: Sequence[Step], index: int) -> bool:
        """The steps at ``index`` form the window's first chunk's canonical, which the store does
        not hold, and serve the chunk as it, with no formation after: the forward runs in the
        window's kept cache, so the next op or answer appends to it instead of placing the chunk
        there again (engines that keep caches)."""
        order, keeps = self.state.order, self.core.backend.supports_extend
        return keeps and serves_canonical_first(steps, index, order) and self._unstored(steps[index].ref)

    def _unstored(self, ref: ChunkRef) -> bool:
        """The store lacks ``ref``'s canonical (else serving it runs no forward to share)."""
        return not self.txn.store.has_canonical(self.state.entries[ref].chunk.key)

    def _slot(self, ref: ChunkRef) -> int:
        return self._slots[ref]

    def _collect_run(self, steps: Sequence[Step], index: int) -> tuple[list[Step], int]:
        """The in-window formation at ``index`` and the ones planned to share its forward (an
        admitted chunk's ``form_canonical`` in between is done first; so are the placed chunks between
        members, where the planner let a formation join across them: `Rules.across_gap`)."""
        run, index = [steps[index]], index + 1
        gaps = self.core.backend.supports_gaps
        between: list[Step] = []
        resume = index
        while index < len(steps):
            step = steps[index]
            if step.kind == "form_patch" and step.in_run:
                for placed in between:  # KV from the store or a canonical: no member needed
                    self._apply(placed)
                run.append(step)
                between, resume = [], index + 1
            elif step.kind == "form_canonical" or (step.kind != "form_patch" and gaps):
                between.append(step)
            else:
                break
            index += 1
        return run, resume  # steps after the last member are run one by one

    def _apply(self, step: Step) -> None:
        entry = self.state.entries[step.ref]
        if step.kind == "form_canonical":
            self.canonical(step.ref)
        elif step.kind == "rotate" and step.source is not None:  # the KV its same-content holder had
            held, patch, full = self._held[step.source]
            self._reused(step.ref)
            states = self._held_edges[step.source]  # the planner mapped those edges in this order
            self._settle(step.ref, held, patch, step.antecedents, full=full, states=states)
        elif step.kind == "rotate":
            if step.ref in self._moved:
                self._reused(step.ref)
            self._settle(step.ref, entry.state, entry.patch, step.antecedents)
        elif step.kind == "apply_patch":
            self._apply_stored(step, entry.chunk)
        elif step.kind == "form_patch":  # off-window: a recall's original context
            self._form_over(step.ref, step.state, step.antecedents or ())
        else:  # revert, defer: the canonical alone
            self._settle(step.ref, step.state, None, (), pending=step.kind == "defer")
            self._reused(step.ref)

    def _apply_stored(self, step: Step, chunk: Chunk) -> None:
        """Serve the step's state from the store: its full KV or its patch. One that has left the
        store since planning is formed instead (the same state: a state names what the KV
        encodes, not where it came from)."""
        if step.state.is_full:
            held = self._full.get(step.state.digest)
            if held is None:
                held = self.core.stored_full(step.state, self.txn)
            if held is None:
                self._form_over(step.ref, step.state, step.antecedents or ())
                return
            self._full[step.state.digest] = held
            self._settle(step.ref, step.state, None, step.antecedents, full=held)
        else:
            patch = self.core.stored_patch(step.state, step.variant, self.txn)
            if patch is None:
                self._form_over(step.ref, step.state, step.antecedents or ())
                return
            self._settle(step.ref, step.state, patch, step.antecedents)
        self.txn.meter.patches_applied += 1
        self._reused(step.ref)

    # -- forming patches --------------------------------------------------------------------------
    def _form_in_window(self, run: Sequence[Step], lead: Step | None = None) -> None:
        """Patches for in-window chunks, each over everything to its left: one forward.

        ``lead``: the window's first chunk, served as its canonical (a ``revert``), computed in
        the same forward before the consecutive members (`_leads_a_run`) and stored as such.

        The members are consecutive, or have placed chunks between them (`Rules.across_gap`):
        those are placed first and each member sees the placed slots to its left and the
        members before it (``starts``/``sees``). Where the engine keeps caches, the forward runs
        over the window's kept cache (cut back to the chunks before the run that did not
        change, the rest placed onto it) and that cache is kept again: with the run's chunks
        whose KV is this forward's exact output when the run is consecutive (an answer right
        after a push then places nothing but its query), up to the first member otherwise (the
        members sit after the placed chunks in it)."""
        order, members = self.state.order, {step.ref for step in run}
        chunks = [self.state.entries[step.ref].chunk for step in run]
        if lead is not None:  # slot 0, the members (if any) right after it
            count, last = 0, self._slots[run[-1].ref] if run else 0
            chunks = [self.state.entries[lead.ref].chunk, *chunks]
            members.add(lead.ref)
        else:
            count, last = self._slots[run[0].ref], self._slots[run[-1].ref]
        between = [ref for ref in order[count:last] if ref not in members]
        placed = self._places(between)
        self.txn.meter.tokens_placed += sum(kv.num_tokens for kv in placed)
        keeps = self.core.backend.supports_extend
        if count == 0 and not between and not self.core.anchor_ready:  # the anchor joins this forward
            cache, context = None, []
            pieces: list[Piece] = [(("anchor",), self.core.anchor.num_tokens)]
        elif keeps:
            cache, pieces = self._cache_through(count)
            cached, context = sum(slots for _, slots in pieces), placed
        else:
            cache, context = None, [self.core.anchor_kv(self.txn.meter), *self._places(order[:count])]
            cached, context = sum(kv.num_tokens for kv in context), [*context, *placed]
        starts: list[int] | None = None
        sees: list[int] | None = None
        if between:
            slots = dict(zip(between, (kv.num_tokens for kv in placed), strict=True))
            starts, sees, seen = [self._starts[step.ref] for step in run], [], cached
            for ref in order[count : last + 1]:
                if ref in members:
                    sees.append(seen)
                else:
                    seen += slots[ref]
        start = self._starts[run[0].ref if lead is None else lead.ref]
        done = self.core.condition(chunks, context, start, self.txn, onto=cache, starts=starts, sees=sees)
        formed = self.core.position_free(done.kv)
        if lead is not None:
            self._lead_canonical(lead, formed.pop(0))
        for step, kv in zip(run, formed, strict=True):
            self._adopt(step.ref, step.state, kv, step.antecedents or ())
        if not keeps or done.cache is None:
            return
        if lead is not None:
            chunk = chunks.pop(0)
            pieces.append(((lead.ref, self._starts[lead.ref], lead.state.digest), chunk.num_tokens))
        for step, chunk in zip(run, chunks, strict=True):
            if between or not step.state.is_full:  # out of window order / canonical + patch
                break
            pieces.append(((step.ref, self._starts[step.ref], step.state.digest), chunk.num_tokens))
        self.state.assembled = Assembled(done.cache, tuple(pieces))

    def _lead_canonical(self, lead: Step, conditioned: ChunkKV) -> None:
        """The lead's KV from the run's forward is its canonical: stored, and the chunk served as
        it (what ``form_canonical`` then ``revert`` do, without the forward of its own)."""
        entry = self.state.entries[lead.ref]
        meter = self.txn.meter
        fresh = entry.chunk.key not in meter.prefilled
        self.core.keep_canonical(entry.chunk, conditioned, self.txn)
        if fresh:
            meter.reforms += int(entry.canonical_formed)
        entry.canonical_formed = True
        self._settle(lead.ref, lead.state, None, ())
        self._reused(lead.ref)

    def _form_over(self, ref: ChunkRef, target: ChunkState, antecedents: Sequence[ChunkRef]) -> None:
        """Form ``ref``'s patch over the context its target state names, placed behind the anchor."""
        chunk = self.state.entries[ref].chunk
        if target.kind == "recomputed":  # rebuilt as it was made, not formed (it is not that forward)
            self._settle(ref, target, None, antecedents, full=self._full_kv(target, chunk))
            return
        kv = self._conditioned_over(chunk, target.context)
        self._adopt(ref, target, kv, antecedents)

    def _conditioned_over(self, chunk: Chunk, context: Context) -> ChunkKV:
        placed, start = self._placed_context(context)
        return self.core.condition([chunk], placed, start, self.txn).kv[0]

    def _placed_context(self, context: Context) -> tuple[list[ChunkKV], int]:
        """The anchor and ``context``'s states placed back to back behind it, and where a chunk
        after them starts."""
        jobs, start = [], self.core.anchor.advance
        for state in context.states():
            source = self._chunk_for(state.chunk_key)
            jobs.append((*self.free_kv(state), source.positions_at(start)))
            start += source.advance
        return [self.core.anchor_kv(self.txn.meter), *self.core.place_many(jobs)], start

    def _recomputed_over(self, chunk: Chunk, state: ChunkState) -> ChunkKV:
        """A recomputed state's KV made again as it was first made: its source placed behind its
        context, its most deviating tokens recomputed over it (`KVCore.recompute`)."""
        assert state.source is not None
        placed, start = self._placed_context(state.context)
        reference, patch = self.free_kv(state.source)
        kv = self.core.place(reference, patch, chunk.positions_at(start))
        return self.core.recompute(chunk, kv, placed, start, state.share, self.txn).kv

    def recompute(self, ref: ChunkRef, share: float) -> ChunkState:
        """Recompute the in-window chunk's most deviating ``share`` of tokens over the chunks to its
        left as they are now (`KVCore.recompute`): its new state, stored and settled.

        Why: the cheapest fix a drift budget has for one chunk whose own KV drifted (what it
        absorbed elsewhere), where re-prefilling it and everything after it costs far more."""
        order, entries = self.state.order, self.state.entries
        i = order.index(ref)
        ctx = self.core.root
        for left in order[:i]:
            ctx = ctx.extend(entries[left].state)
        entry = entries[ref]
        target = ChunkState.recomputed(entry.state, ctx, share)
        placed = self.placements()
        start = self._starts[ref]
        blended = self.core.recompute(entry.chunk, placed[i + 1], placed[: i + 1], start, share, self.txn)
        kv = self.core.keep_full(target, blended.kv, self.txn)
        self._full[target.digest] = kv
        # what it encoded before (a chunk that left, maybe recalled later) it still encodes in part
        recorded = self.state.recorded(ref)
        kept = {source for source, _, _ in recorded}
        joined = [(r, s.digest) for r, s in zip(order[:i], ctx.states(), strict=True) if r not in kept]
        refs = (*(source for source, _, _ in recorded), *(r for r, _ in joined))
        digests = (*(digest for _, _, digest in recorded), *(d for _, d in joined))
        self._settle(ref, target, None, None, full=kv)
        self.state.set_antecedents(ref, refs, digests)
        return target

    def _adopt(
        self, ref: ChunkRef, target: ChunkState, conditioned: ChunkKV, antecedents: Sequence[ChunkRef]
    ) -> None:
        """Give ``ref`` what ``conditioned`` says (`KVCore.keep_full` / `keep_patch`: the state's
        stored KV, folded into its orbit where orbits are kept)."""
        self.txn.meter.patches_formed += 1
        orbit = self.config.orbit
        if target.is_full:
            kv = self.core.keep_full(target, conditioned, self.txn, orbit=orbit)
            self._full[target.digest] = kv
            self._settle(ref, target, None, antecedents, full=kv)
            return
        patch = self.core.keep_patch(self.canonical(ref), target, conditioned, self.txn, orbit=orbit)
        self._settle(ref, target, patch, antecedents)

    def _settle(
        self,
        ref: ChunkRef,
        target: ChunkState,
        patch: Patch | None,
        antecedents: Sequence[ChunkRef] | None,
        pending: bool = False,
        full: ChunkKV | None = None,
        states: Sequence[str] | None = None,
    ) -> None:
        """Record the chunk's new KV: state, patch, graph edges; its first settled state is its home.

        ``states``: the state each antecedent's edge records, where ``target``'s context does not
        say them (a KV taken from another chunk records what that chunk's edges recorded)."""
        entry = self.state.entries[ref]
        same_state = target == entry.state
        if not same_state or full is not None:
            entry.full = full
        entry.state, entry.patch, entry.pending = target, patch, pending
        # a recomputed state's edges were filed when it was made: its kept tokens still encode
        # its source's antecedents, which its context (the chunks now to its left) does not name
        kept = same_state and target.kind == "recomputed"
        if antecedents is not None and not kept and not (same_state and self._same_edges(ref, antecedents)):
            self.state.set_antecedents(ref, antecedents, states)
        if entry.original is None and not pending:
            entry.original = OriginalContext(tuple(antecedents or ()), target)

    def _same_edges(self, ref: ChunkRef, antecedents: Sequence[ChunkRef]) -> bool:
        """The graph already records exactly these antecedents for ``ref`` (its state unchanged,
        so each edge's state is too): rewriting its edges would change nothing."""
        state = self.state
        if state.entries[ref].set_from == tuple(antecedents):  # what they were set from (one compare)
            return True  # (a source forgotten since left both the graph and the check below)
        entries = state.entries
        return tuple(source for source in antecedents if source in entries) == state.antecedents_of(ref)

    # -- KV of chunks and states -------------------------------------------------------------------
    def canonical(self, ref: ChunkRef) -> ChunkKV:
        """The chunk's canonical (a prefill when the store has none: a re-form if it had one)."""
        entry = self.state.entries[ref]
        meter = self.txn.meter
        fresh = entry.chunk.key not in meter.prefilled
        canonical = self.core.canonical(entry.chunk, self.txn)
        if fresh and entry.chunk.key in meter.prefilled:
            meter.reforms += int(entry.canonical_formed)
        entry.canonical_formed = True
        return canonical

    def free_kv(self, state: ChunkState) -> tuple[ChunkKV, Patch | None]:
        """What a state is made of, position-free: its full KV, or its canonical and patch; from
        the store, or rebuilt (original contexts, entries the store has dropped)."""
        if state.digest in self._free:
            return self._free[state.digest]
        holder = self._holder(state)
        if holder is not None:  # a chunk in the window has it (its patch or KV may be held only there)
            self._free[state.digest] = self._made_of(holder)
            return self._free[state.digest]
        chunk = self._chunk_for(state.chunk_key)
        patch: Patch | None = None
        reference = self._full_kv(state, chunk) if state.is_full else self.core.canonical(chunk, self.txn)
        if state.kind == "orbit" and not state.is_full:
            patch = self.core.stored_patch(state, state.address, self.txn)
        elif state.kind == "patched" and not state.is_full:
            patch = self.core.stored_patch(state, state.digest, self.txn)
            if patch is None:
                conditioned = self._conditioned_over(chunk, state.context)
                patch = self.core.keep_patch(reference, state, conditioned, self.txn)
                self.txn.meter.patches_formed += 1
        self._free[state.digest] = (reference, patch)
        return reference, patch

    def _full_kv(self, state: ChunkState, chunk: Chunk, held: bool = False) -> ChunkKV:
        """A full-rank state's KV: from this op, the store, or one conditioned forward (stored).

        ``held``: a chunk in the window holds this state, so its KV was stored once and missing
        now means a budget dropped it (a re-form)."""
        if state.digest in self._full:
            return self._full[state.digest]
        kv = self.core.stored_full(state, self.txn)
        if kv is None and state.kind == "recomputed":
            kv = self.core.keep_full(state, self._recomputed_over(chunk, state), self.txn)
            self.txn.meter.reforms += int(held)
        elif kv is None:
            kv = self.core.keep_full(state, self._conditioned_over(chunk, state.context), self.txn)
            self.txn.meter.reforms += int(held)
        self._full[state.digest] = kv
        return kv

    def placed_kv(self, ref: ChunkRef) -> ChunkKV:
        """The chunk's KV at its place in the window."""
        return self._places([ref])[0]

    def _places(self, refs: Sequence[ChunkRef]) -> list[ChunkKV]:
        """In-window chunks at their places, those not yet placed in this op rotated together."""
        keys = [(ref, self._starts[ref], self.state.entries[ref].state.digest) for ref in refs]
        missing = [key for key in dict.fromkeys(keys) if key not in self._placed]
        entries = self.state.entries
        jobs = [(*self._made_of(ref), entries[ref].chunk.positions_at(start)) for ref, start, _ in missing]
        self._placed.update(zip(missing, self.core.place_many(jobs), strict=True))
        return [self._placed[key] for key in keys]

    def placements(self) -> list[ChunkKV]:
        """The anchor and every in-window chunk, placed: what a decode attends to."""
        return [self.core.anchor_kv(self.txn.meter), *self._places(self.state.order)]

    def window_cache(self) -> Any:
        """The engine cache holding the window as it is now.

        Why incremental: an agent pushes, asks, pushes, asks. Where the engine can crop and
        extend a cache, the one the last answer used is cut back to the longest run of leading
        chunks that did not change (same place, same state) and only the rest is placed and
        appended: a push then costs its own tokens, not a copy of the window. A chunk that moved
        or changed state, and everything after it, is placed again.
        """
        cache, pieces = self._cache_through(len(self.state.order))
        self.state.assembled = Assembled(cache, tuple(pieces)) if self.core.backend.supports_extend else None
        return cache

    def _cache_through(self, count: int) -> tuple[Any, list[Piece]]:
        """An engine cache holding the anchor and the first ``count`` in-window chunks as they
        are now, built on the kept one where the engine can (see `window_cache`), and its pieces."""
        backend, state = self.core.backend, self.state
        pieces: list[Piece] = [(("anchor",), self.core.anchor.num_tokens)]
        for ref in state.order[:count]:
            entry = state.entries[ref]
            pieces.append(((ref, self._starts[ref], entry.state.digest), entry.chunk.num_tokens))
        memo, keep = state.assembled, 0
        if backend.supports_extend and memo is not None:
            for mine, theirs in zip(pieces, memo.pieces, strict=False):
                if mine != theirs:
                    break
                keep += 1
        if keep == 0:
            cache = backend.assemble(
                [self.core.anchor_kv(self.txn.meter), *self._places(state.order[:count])]
            )
        else:
            assert memo is not None
            cache = backend.crop(memo.cache, sum(slots for _, slots in pieces[:keep]))
            cache = backend.assemble(self._places(state.order[keep - 1 : count]), onto=cache)
        self.txn.meter.tokens_placed += sum(slots for _, slots in pieces[keep:])
        return cache, pieces

    # -- reading the window ------------------------------------------------------------------------
    def answer(self, query_ids: torch.Tensor, config: DecodeConfig) -> Answer:
        """Decode the query over the window as it is."""
        return self.core.decode(self.window_cache(), query_ids, self.end(), config, self.txn.meter)

    def answer_without(
        self, removed: ChunkRef, query_ids: torch.Tensor, config: DecodeConfig, *, exact: bool = True
    ) -> Answer:
        """Decode with ``removed`` left out and its influence taken off the chunks that encode it.

        The chunks before it keep their KV (the kept engine cache is cut back to them). Each
        later chunk that encodes it is served by a stored state for its reduced left context
        (full KV, a patch), else by its canonical where the store holds one; from the first
        that has neither, the rest are formed over what is placed before them in one forward,
        exactly (a prefix cache's re-prefill from there, never more tokens), and stored as the
        states they are, so the same probe again, or evicting ``removed``, finds them.

        ``exact=False``: such chunks are served by their canonicals, formed where missing (each
        once, for every probe after it): what ranking every chunk of a window costs in decodes
        only, where exact views would re-prefill the rest once per chunk."""
        state, core, meter = self.state, self.core, self.txn.meter
        slot = state.order.index(removed)
        influenced = _Influence(state.entries[removed].state.digest)
        ctx, start = core.root, core.anchor.advance
        for ref in state.order[:slot]:
            entry = state.entries[ref]
            ctx, start = ctx.extend(entry.state), start + entry.chunk.advance
        rest = state.order[slot + 1 :]
        jobs, formed_from = [], len(rest)
        pieces: list[Piece] = []
        for i, ref in enumerate(rest):
            entry = state.entries[ref]
            served = entry.state
            if removed in state.graph.pred[ref] or influenced(entry.state):
                served = self._reduced(ref, ctx)
                if exact and served.kind == "canonical" and not self.txn.store.has_canonical(ref.key):
                    formed_from = i
                    break
            reference, patch = self.free_kv(served) if served != entry.state else self._made_of(ref)
            jobs.append((reference, patch, entry.chunk.positions_at(start)))
            pieces.append(((ref, start, served.digest), entry.chunk.num_tokens))
            ctx, start = ctx.extend(served), start + entry.chunk.advance
        placed = core.place_many(jobs)
        meter.tokens_placed += sum(kv.num_tokens for kv in placed)
        keeps = core.backend.supports_extend
        context: list[ChunkKV] = []
        if keeps:
            cache, kept = self._cache_through(slot)
            cache = core.backend.assemble(placed, onto=cache)
            pieces = [*kept, *pieces]
        else:
            context = [core.anchor_kv(meter), *self._places(state.order[:slot]), *placed]
            cache = None
        formed = [state.entries[ref].chunk for ref in rest[formed_from:]]
        if formed:
            done = core.condition(formed, context, start, self.txn, onto=cache)
            for chunk, kv in zip(formed, done.kv, strict=True):
                over = ChunkState.patched(chunk.key, "full", ctx)  # exact over what is left
                core.keep_full(over, kv, self.txn)
                meter.patches_formed += 1
                pieces.append(((rest[formed_from], start, over.digest), chunk.num_tokens))
                formed_from, ctx, start = formed_from + 1, ctx.extend(over), start + chunk.advance
            if keeps and done.cache is not None:
                cache = done.cache
            else:  # the engine kept no cache: the whole view assembled anew
                before = [core.anchor_kv(meter), *self._places(state.order[:slot])]
                cache, keeps = core.backend.assemble([*(context or [*before, *placed]), *done.kv]), False
                self.state.assembled = None  # the kept one may have been cut back: it says no more
        elif not keeps:
            cache = core.backend.assemble(context)
        if keeps:
            self.state.assembled = Assembled(cache, tuple(pieces))
        return core.decode(cache, query_ids, start, config, meter)

    def _reduced(self, ref: ChunkRef, ctx: Context) -> ChunkState:
        """The state ``ref`` can be served in over ``ctx`` from the store (its full KV there, a
        stored patch), else its canonical: the view with a chunk's influence switched off."""
        canonical = ChunkState.canonical(ref.key, self.core.root)
        rank = self.config.effective_rank
        if rank == 0 or ctx.length == 0:
            return canonical
        full = ChunkState.patched(ref.key, "full", ctx)
        if self.txn.store.has_full(ref.key, full.digest):
            return full
        n = self.state.entries[ref].chunk.num_tokens
        target = ChunkState.patched(ref.key, effective_rank(rank, n, self.layout.features), ctx)
        if not target.is_full and self.txn.store.has_patch(ref.key, target.digest):
            return target
        return canonical

    def _made_of(self, ref: ChunkRef) -> tuple[ChunkKV, Patch | None]:
        """What an in-window chunk's KV is made of now: its full KV, or its canonical and patch."""
        entry = self.state.entries[ref]
        if entry.full is not None:
            return entry.full, None
        if entry.state.is_full:
            return self._full_kv(entry.state, entry.chunk, held=True), None
        return self.canonical(ref), entry.patch

    def end(self) -> int:
        """The position after the window's last chunk (where a query starts)."""
        return self.core.anchor.advance + sum(self.state.entries[r].chunk.advance for r in self.state.order)

    # -- helpers -------------------------------------------------------------------------------------
    def _order_changed(self) -> None:
        self._starts, position = {}, self.core.anchor.advance
        self._slots = {ref: i for i, ref in enumerate(self.state.order)}
        for ref in self.state.order:
            self._starts[ref] = position
            position += self.state.entries[ref].chunk.advance

    def _reused(self, ref: ChunkRef) -> None:
        chunk = self.state.entries[ref].chunk
        self.txn.meter.reuse(ref, chunk.key, chunk.num_tokens)

    def _holder(self, state: ChunkState) -> ChunkRef | None:
        """An in-window chunk in exactly this state, if any."""
        for ref in self.state.order:
            entry = self.state.entries[ref]
            if entry.state.digest == state.digest and not entry.pending:
                return ref
        return None

    def _chunk_for(self, chunk_key: str) -> Chunk:
        if self._by_key is None:
            self._by_key = {entry.chunk.key: entry.chunk for entry in self.state.entries.values()}
        return self._by_key[chunk_key]


class _Influence:
    """Whether a state's KV carries (directly or through its antecedents) one state's influence."""

    def __init__(self, digest: str) -> None:
        self.digest = digest
        self._memo: dict[str, bool] = {}

    def __call__(self, state: ChunkState) -> bool:
        if state.digest not in self._memo:
            self._memo[state.digest] = any(s.digest == self.digest or self(s) for s in state.antecedents())
        return self._memo[state.digest]


def _changes(state: WindowState, plan: WindowPlan) -> bool:
    """Whether the plan changes the window's KV (an answer computed before it is then stale)."""
    if plan.evicted or plan.admitted or plan.moved or list(plan.order) != state.order:
        return True
    return any(step.kind not in ("form_canonical", "rotate") for step in plan.steps)


def _recorded_states(state: WindowState, ref: ChunkRef) -> tuple[str, ...]:
    """The states ``ref``'s in-edges record, in their recorded order (`Planner._taken` maps the
    same edges, in this order, onto the refs that hold those slots after the op)."""
    return tuple(digest for _, _, digest in state.recorded(ref))
