"""Answering with one chunk switched off: the view a probe decodes over.

Why apart from running plans: a probe changes no state of the window. It serves the chunks
after the removed one by what the store holds for their reduced left context, forms the rest in
one forward (exact, stored as the states they are, so the same probe again or evicting the chunk
finds them) and decodes; nothing of it is a step of a plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.core.identity import ChunkState, Context, effective_rank
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.results import Answer
from kamera_agent.window.placement import Placement, Stretch
from kamera_agent.window.state import Assembled, ChunkRef

__all__ = ["answer_without"]


@dataclass
class _View:
    """The chunks after the removed one as the view serves them: placed jobs, the cache stretches
    they take, and from which of them (``formed_from``) the rest must be formed."""

    slot: int
    rest: Sequence[ChunkRef]
    ctx: Context
    start: int
    jobs: list[Any] = field(default_factory=list)
    stretches: list[Stretch] = field(default_factory=list)
    formed_from: int = 0


def answer_without(
    placement: Placement, removed: ChunkRef, query_ids: torch.Tensor, config: DecodeConfig, exact: bool
) -> Answer:
    """Decode with ``removed`` left out and its influence taken off the chunks that encode it
    (`Executor.answer_without` says how each chunk is served)."""
    view = _serve(placement, removed, exact)
    core, meter, state = placement.core, placement.txn.meter, placement.state
    placed = core.place_many(view.jobs)
    meter.add(tokens_placed=sum(kv.num_tokens for kv in placed))
    extends = core.backend.supports_extend
    context: list[ChunkKV] = []
    cache: Any = None
    if extends:
        cache, retained = placement._cache_through(view.slot)
        cache = core.backend.assemble(placed, onto=cache)
        view.stretches = [*retained, *view.stretches]
    else:
        context = [core.anchor_kv(meter), *placement._places(state.order[: view.slot]), *placed]
    if view.formed_from < len(view.rest):
        cache, extends = _form_rest(placement, view, placed, context, cache, extends)
    elif not extends:
        cache = core.backend.assemble(context)
    if extends:
        state.assembled = Assembled(cache, tuple(view.stretches))
    return core.decode(cache, query_ids, view.start, config, meter)


def _serve(placement: Placement, removed: ChunkRef, exact: bool) -> _View:
    """The chunks after ``removed`` (and from the first before it that still encodes it: a chunk
    that stood when it came back to its right), each in its own state or a reduced one, up to the
    first that must be formed (``exact``: one whose reduced state is a canonical the store lacks)."""
    state, core = placement.state, placement.core
    at = state.order.index(removed)
    graph = state.graph
    slot = next((i for i, ref in enumerate(state.order[:at]) if removed in graph.pred[ref]), at)
    stood = [ref for ref in state.order[slot:at] if removed in graph.pred[ref]]
    # what they absorbed of it is its state then: the chunks formed over them carry that one too
    then = {digest for ref in stood for source, _, digest in state.recorded(ref) if source == removed}
    influenced = _Influence({state.entries[removed].state.digest, *then})
    ctx, start = core.root, core.anchor.advance
    for ref in state.order[:slot]:
        entry = state.entries[ref]
        ctx, start = ctx.extend(entry.state), start + entry.chunk.advance
    rest = [ref for ref in state.order[slot:] if ref != removed]
    view = _View(slot, rest, ctx, start, formed_from=len(rest))
    for i, ref in enumerate(rest):
        entry = state.entries[ref]
        served = entry.state
        if removed in state.graph.pred[ref] or influenced(entry.state):
            served = _reduced(placement, ref, view.ctx)
            if exact and served.kind == "canonical" and not placement.txn.store.has_canonical(ref.key):
                view.formed_from = i
                break
        made = placement.position_free_parts(served) if served != entry.state else placement._made_of(ref)
        view.jobs.append((*made, entry.chunk.positions_at(view.start)))
        view.stretches.append(((ref, view.start, served.digest), entry.chunk.num_tokens))
        view.ctx, view.start = view.ctx.extend(served), view.start + entry.chunk.advance
    return view


def _form_rest(
    placement: Placement,
    view: _View,
    placed: list[ChunkKV],
    context: list[ChunkKV],
    cache: Any,
    extends: bool,
) -> tuple[Any, bool]:
    """Form the chunks from ``view.formed_from`` on over what is placed before them, in one
    forward, each stored as exact over what is left; the cache to decode over, and whether it is
    the one the engine retains."""
    core, txn, state = placement.core, placement.txn, placement.state
    formed = [state.entries[ref].chunk for ref in view.rest[view.formed_from :]]
    done = core.condition(formed, context, view.start, txn, onto=cache)
    for chunk, kv in zip(formed, done.kv, strict=True):
        over = ChunkState.patched(chunk.key, "full", view.ctx)  # exact over what is left
        core.store_full(over, kv, txn)
        txn.meter.add(patches_formed=1)
        view.stretches.append(((view.rest[view.formed_from], view.start, over.digest), chunk.num_tokens))
        view.formed_from += 1
        view.ctx, view.start = view.ctx.extend(over), view.start + chunk.advance
    if extends and done.cache is not None:
        return done.cache, True
    # the engine retained no cache: the whole view assembled anew
    before = [core.anchor_kv(txn.meter), *placement._places(state.order[: view.slot])]
    state.assembled = None  # the retained one may have been cut back: it says no more
    return core.backend.assemble([*(context or [*before, *placed]), *done.kv]), False


def _reduced(placement: Placement, ref: ChunkRef, ctx: Context) -> ChunkState:
    """The state ``ref`` can be served in over ``ctx`` from the store (its full KV there, a
    stored patch), else its canonical: the view with a chunk's influence switched off."""
    core, store = placement.core, placement.txn.store
    canonical = ChunkState.canonical(ref.key, core.root)
    rank = placement.config.effective_rank
    if rank == 0 or ctx.length == 0:
        return canonical
    full = ChunkState.patched(ref.key, "full", ctx)
    if store.has_full(ref.key, full.digest):
        return full
    n = placement.state.entries[ref].chunk.num_tokens
    target = ChunkState.patched(ref.key, effective_rank(rank, n, placement.layout.features), ctx)
    if not target.is_full and store.has_patch(ref.key, target.digest):
        return target
    return canonical


class _Influence:
    """Whether a state's KV carries (directly or through its antecedents) the influence of one of
    ``digests``: a chunk's state now and those it had where other chunks absorbed it."""

    def __init__(self, digests: set[str]) -> None:
        self.digests = digests
        self._memo: dict[str, bool] = {}

    def __call__(self, state: ChunkState) -> bool:
        if state.digest not in self._memo:
            self._memo[state.digest] = any(s.digest in self.digests or self(s) for s in state.antecedents())
        return self._memo[state.digest]
