"""Executing a window plan as cache edits, and answering over the window.

Why separate from planning: the planner decides from states and a store view; the executor
does what the plan says (place, apply a stored patch, form one with a conditioned forward,
revert, defer) inside one `Txn`, so everything it stores is staged until the op succeeds. The
window restores its state snapshot when anything fails. A stored patch the plan counted on but
that has left the store since is formed instead (its state is the same: a state names what the
KV encodes, not where it came from); an orbit patch that changed under the op raises
`StaleLookup`, and the window plans again. Placing chunks and building the KV their states
name is `kamera_agent.window.placement`'s; the view a probe decodes over, `answers`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from kamera_agent.backends.base import DecodeConfig, Prefilled, Spent
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.core import Patch
from kamera_agent.core.identity import ChunkState
from kamera_agent.core.kv_core import StaleLookup
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.results import Answer
from kamera_agent.window.answers import answer_without
from kamera_agent.window.placement import Placement, Stretch
from kamera_agent.window.plan import Step, WindowPlan, canonical_leads_run, serves_canonical_first
from kamera_agent.window.state import Assembled, ChunkRef, Entry, OriginalContext, WindowRecord
from kamera_agent.window.tail import fed_ids, rest_after

__all__ = ["Executor", "StaleLookup"]


class Executor(Placement):
    """Applies plans to one window state inside one transaction; places chunks; decodes."""

    # -- running a plan -------------------------------------------------------------------------
    def run(self, plan: WindowPlan, steps: Sequence[Step] | None = None) -> None:
        """Apply ``plan``: evictions, admissions, the new order, then every step left to right
        (``steps``: only those, the rest left to `perform`)."""
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
        self._moved = plan.moved
        self._tail = plan.tail  # the first in-window formation reuses it (`with_tail` checked)
        self.perform(plan.steps if steps is None else steps)

    def perform(self, planned: Sequence[Step]) -> None:
        """Run ``planned`` steps left to right over the window's order as it is now."""
        steps, index = list(planned), 0
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
        window's retained cache, so the next op or answer appends to it instead of placing the chunk
        there again (engines that retain caches)."""
        order, extends = self.state.order, self.core.backend.supports_extend
        return extends and serves_canonical_first(steps, index, order) and self._unstored(steps[index].ref)

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
        self.txn.meter.add(patches_applied=1)
        self._reused(step.ref)

    # -- forming patches --------------------------------------------------------------------------
    def _form_in_window(self, run: Sequence[Step], lead: Step | None = None) -> None:
        """Patches for in-window chunks, each over everything to its left: one forward.

        ``lead``: the window's first chunk, served as its canonical (a ``revert``), computed in
        the same forward before the consecutive members (`_leads_a_run`) and stored as such.

        The members are consecutive, or have placed chunks between them (`Rules.across_gap`):
        those are placed first and each member sees the placed slots to its left and the
        members before it (``starts``/``sees``). Where the engine retains caches, the forward runs
        over the window's retained cache (cut back to the chunks before the run that did not
        change, the rest placed onto it) and that cache is retained again: with the run's chunks
        whose KV is this forward's exact output when the run is consecutive (an answer right
        after a push then places nothing but its query), up to the first member otherwise (the
        members sit after the placed chunks in it)."""
        order, members = self.state.order, {step.ref for step in run}
        chunks = [self.state.entries[step.ref].chunk for step in run]
        reused, self._tail = (self._tail if lead is None else 0), 0
        if lead is not None:  # slot 0, the members (if any) right after it
            count, last = 0, self._slots[run[-1].ref] if run else 0
            chunks = [self.state.entries[lead.ref].chunk, *chunks]
            members.add(lead.ref)
        else:
            count, last = self._slots[run[0].ref], self._slots[run[-1].ref]
        between = [ref for ref in order[count:last] if ref not in members]
        placed = self._places(between)
        self.txn.meter.add(tokens_placed=sum(kv.num_tokens for kv in placed))
        extends = self.core.backend.supports_extend
        if count == 0 and not between and not self.core.anchor_ready:  # the anchor joins this forward
            cache, context, cached = None, [], 0
            stretches: list[Stretch] = [(("anchor",), self.core.anchor.num_tokens)]
        elif extends:
            cache, stretches = self._cache_through(count, tail=reused)
            cached, context = sum(slots for _, slots in stretches), placed
        else:
            cache, context = None, [self.core.anchor_kv(self.txn.meter), *self._places(order[:count])]
            cached, context = sum(kv.num_tokens for kv in context), [*context, *placed]
        starts, sees = self._seen(run, members, order[count : last + 1], between, placed, cached)
        start = self._starts[run[0].ref if lead is None else lead.ref]
        if reused:
            done = self._formed_after_tail(chunks, cache, cached, reused, start)
        else:
            done = self.core.condition(chunks, context, start, self.txn, onto=cache, starts=starts, sees=sees)
        formed = self.core.position_free(done.kv)
        if lead is not None:
            self._lead_canonical(lead, formed.pop(0))
        for step, kv in zip(run, formed, strict=True):
            self._adopt(step.ref, step.state, kv, step.antecedents or ())
        if not extends or done.cache is None:
            return
        if lead is not None:
            chunk = chunks.pop(0)
            stretches.append(((lead.ref, self._starts[lead.ref], lead.state.digest), chunk.num_tokens))
        for step, chunk in zip(run, chunks, strict=True):
            if between or not step.state.is_full:  # out of window order / canonical + patch
                break
            stretches.append(((step.ref, self._starts[step.ref], step.state.digest), chunk.num_tokens))
        self.state.assembled = Assembled(done.cache, tuple(stretches))

    def _formed_after_tail(
        self, chunks: Sequence[Chunk], cache: Any, slot: int, reused: int, start: int
    ) -> Prefilled:
        """A consecutive run's KV where the retained cache holds its first ``reused`` tokens from
        the last decode (from ``slot``, at ``start``): the rest is prefilled onto it, then every
        chunk's KV is read out of the cache (`kamera_agent.window.tail`)."""
        rest, at = rest_after(chunks, reused, start)
        if rest:
            cache = self.core.condition(rest, [], at, self.txn, onto=cache).cache
        positions, where = [], start
        for chunk in chunks:
            positions.append(chunk.positions_at(where))
            where += chunk.advance
        kv = self.core.backend.read_slots(cache, slot, positions, [chunk.key for chunk in chunks])
        self.txn.meter.add(tokens_reused=reused)
        return Prefilled(tuple(kv), Spent(), cache)

    def _seen(
        self,
        run: Sequence[Step],
        members: set[ChunkRef],
        span: Sequence[ChunkRef],
        between: Sequence[ChunkRef],
        placed: Sequence[ChunkKV],
        cached: int,
    ) -> tuple[list[int] | None, list[int] | None]:
        """Where each member of a run with placed chunks between starts, and how many cache
        slots it sees (the placed ones to its left, after the ``cached`` before the run);
        ``None`` for a consecutive run (each sees everything before it)."""
        if not between:
            return None, None
        slots = dict(zip(between, (kv.num_tokens for kv in placed), strict=True))
        starts, sees, seen = [self._starts[step.ref] for step in run], [], cached
        for ref in span:
            if ref in members:
                sees.append(seen)
            else:
                seen += slots[ref]
        return starts, sees

    def _lead_canonical(self, lead: Step, conditioned: ChunkKV) -> None:
        """The lead's KV from the run's forward is its canonical: stored, and the chunk served as
        it (what ``form_canonical`` then ``revert`` do, without the forward of its own)."""
        entry = self.state.entries[lead.ref]
        meter = self.txn.meter
        fresh = entry.chunk.key not in meter.prefilled
        self.core.store_canonical(entry.chunk, conditioned, self.txn)
        if fresh:
            meter.add(reforms=int(entry.canonical_formed))
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

    def recompute(self, ref: ChunkRef, share: float, head: bool = False) -> ChunkState:
        """Recompute the in-window chunk's most deviating ``share`` of tokens (``head``: its first)
        over the chunks to its left as they are now (`KVCore.recompute`): its new state, stored
        and settled.

        Why: the cheapest fix a drift budget has for one chunk whose own KV drifted (what it
        absorbed elsewhere), where re-prefilling it and everything after it costs far more."""
        order, entries = self.state.order, self.state.entries
        i = order.index(ref)
        ctx = self.core.root
        for left in order[:i]:
            ctx = ctx.extend(entries[left].state)
        entry = entries[ref]
        target = ChunkState.recomputed(entry.state, ctx, share, head)
        placed = self.placements(i + 1)
        start = self._starts[ref]
        recomputed = self.core.recompute(
            entry.chunk, placed[i + 1], placed[: i + 1], start, share, self.txn, head=head
        )
        kv = self.core.store_full(target, recomputed.kv, self.txn)
        self._full[target.digest] = kv
        # what it encoded before (a chunk that left, maybe recalled later) it still encodes in part
        recorded = self.state.recorded(ref)
        sources = {source for source, _, _ in recorded}
        joined = [(r, s.digest) for r, s in zip(order[:i], ctx.states(), strict=True) if r not in sources]
        refs = (*(source for source, _, _ in recorded), *(r for r, _ in joined))
        digests = (*(digest for _, _, digest in recorded), *(d for _, d in joined))
        self._settle(ref, target, None, None, full=kv)
        self.state.set_antecedents(ref, refs, digests)
        return target

    def _adopt(
        self, ref: ChunkRef, target: ChunkState, conditioned: ChunkKV, antecedents: Sequence[ChunkRef]
    ) -> None:
        """Give ``ref`` what ``conditioned`` says (`KVCore.store_full` / `store_patch`: the state's
        stored KV, folded into its orbit where orbits are on)."""
        self.txn.meter.add(patches_formed=1)
        orbit = self.config.orbit
        if target.is_full:
            kv = self.core.store_full(target, conditioned, self.txn, orbit=orbit)
            self._full[target.digest] = kv
            self._settle(ref, target, None, antecedents, full=kv)
            return
        patch = self.core.store_patch(self.canonical(ref), target, conditioned, self.txn, orbit=orbit)
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
        # a recomputed state's edges were filed when it was made: its tokens not recomputed still encode
        # its source's antecedents, which its context (the chunks now to its left) does not name
        filed = same_state and target.kind == "recomputed"
        if antecedents is not None and not filed and not (same_state and self._same_edges(ref, antecedents)):
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

    # -- reading the window ------------------------------------------------------------------------
    def answer(self, query_ids: torch.Tensor, config: DecodeConfig, count: int | None = None) -> Answer:
        """Decode the query over the window as it is (its first ``count`` chunks: all by default,
        fewer for a drift verdict's probe, which the op's trailing content follows); the retained
        cache then records what the decode fed after them (`Assembled.tail`)."""
        cache = self.window_cache(count)
        answer = self.core.decode(cache, query_ids, self.end(count), config, self.txn.meter)
        memo = self.state.assembled
        if memo is not None:
            self.state.assembled = replace(memo, tail=fed_ids(query_ids, answer))
        return answer

    def answer_without(
        self, removed: ChunkRef, query_ids: torch.Tensor, config: DecodeConfig, *, exact: bool = True
    ) -> Answer:
        """Decode with ``removed`` left out and its influence taken off the chunks that encode it.

        The chunks before it stay as they are (the retained engine cache is cut back to them), up
        to the first that still encodes it (one that stood when it came back to its right). Each
        later chunk that encodes it is served by a stored state for its reduced left context
        (full KV, a patch), else by its canonical where the store holds one; from the first
        that has neither, the rest are formed over what is placed before them in one forward,
        exactly (a prefix cache's re-prefill from there, never more tokens), and stored as the
        states they are, so the same probe again, or evicting ``removed``, finds them.

        ``exact=False``: such chunks are served by their canonicals, formed where missing (each
        once, for every probe after it): what ranking every chunk of a window costs in decodes
        only, where exact views would re-prefill the rest once per chunk."""
        return answer_without(self, removed, query_ids, config, exact)


def _changes(state: WindowRecord, plan: WindowPlan) -> bool:
    """Whether the plan changes the window's KV (an answer computed before it is then stale)."""
    if plan.evicted or plan.admitted or plan.moved or list(plan.order) != state.order:
        return True
    return any(step.kind not in ("form_canonical", "rotate") for step in plan.steps)


def _recorded_states(state: WindowRecord, ref: ChunkRef) -> tuple[str, ...]:
    """The states ``ref``'s in-edges record, in their recorded order (`Planner._taken` maps the
    same edges, in this order, onto the refs that hold those slots after the op)."""
    return tuple(digest for _, _, digest in state.recorded(ref))
