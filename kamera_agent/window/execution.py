"""Executing window plans as cache edits, placing chunks, and answering over the window.

Why here: every edit (rotate, apply or form a patch, revert, defer) changes one chunk's entry
and the antecedent graph, and may run a conditioned forward; placement turns a canonical plus
its patch into KV at the chunk's current positions (memoised per position and patch). A failed
plan restores the state snapshot taken before it ran.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kamera_agent.backends.base import Backend, DecodeConfig
from kamera_agent.errors import ContextOverflowError
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.operator.patch import Patch, apply_patch, form_patch, merge_patches
from kamera_agent.results import Answer, OpCost
from kamera_agent.window.base import WindowCore
from kamera_agent.window.costs import CostMeter
from kamera_agent.window.planner import Step, WindowPlan, formable_run
from kamera_agent.window.state import ChunkRef, Entry

__all__ = ["ExecutionMixin"]


class ExecutionMixin(WindowCore):
    """Runs plans, forms patches, places chunks and decodes queries."""

    def _transact(self, plan: WindowPlan) -> OpCost:
        snapshot, placed = self._state.copy(), dict(self._placed)
        meter = CostMeter(self.backend.counters)
        try:
            self._execute(plan, meter)
        except BaseException:
            self._state, self._placed = snapshot, placed
            raise
        cost = meter.finish()
        self._book.record(plan.op, cost)
        return cost

    def _execute(self, plan: WindowPlan, meter: CostMeter) -> None:
        state = self._state
        state.tick += 1
        for ref in plan.evicted:
            state.entries[ref].in_window = False
            self._placed.pop(ref, None)
        for ref in plan.admitted:
            if ref not in state.entries:
                home = tuple(plan.order[: plan.order.index(ref)])
                state.add(ref, Entry(plan.chunks[ref], home=home))
                state.next_id = max(state.next_id, ref.id + 1)
            entry = state.entries[ref]
            entry.in_window, entry.last_used = True, state.tick
        state.order = list(plan.order)
        if plan.op == "reorder":
            for ref in plan.order:
                state.entries[ref].last_used = state.tick
        steps, index = list(plan.steps), 0
        while index < len(steps):
            run = formable_run(steps, index, self._state.order)
            if len(run) > 1:  # consecutive chunks, each re-patched on all of its left: one forward
                self._form_run(run, meter)
                index += len(run)
            else:
                self._apply(steps[index], meter)
                index += 1

    def _apply(self, step: Step, meter: CostMeter) -> None:
        entry, state, n = self._state.entries[step.ref], self._state, self._entry(step.ref).chunk.num_tokens
        if step.kind == "encode":
            self._canonical(step.ref, meter)
        elif step.kind == "rotate":
            meter.reuse(step.ref, n)
        elif step.kind == "apply_patch":
            patch = self.store.get_patch(step.ref.key, step.signature)
            if patch is None:  # dropped from the store since planning: form it instead
                self._form(step.ref, step.antecedents, meter)
                return
            entry.patch, entry.pending = patch, False
            state.set_encodes(step.ref, step.antecedents)
            meter.patches_applied += 1
            meter.reuse(step.ref, n)
        elif step.kind == "form_patch":
            self._form(step.ref, step.antecedents, meter)
        else:  # revert, defer
            entry.patch, entry.pending = None, step.kind == "defer"
            state.set_encodes(step.ref, ())
            meter.reuse(step.ref, n)

    def _form(self, ref: ChunkRef, context: Sequence[ChunkRef], meter: CostMeter) -> None:
        """One conditioned forward of ``ref`` over ``context`` → patch (stored, orbit updated)."""
        state, entry = self._state, self._entry(ref)
        canonical = self._canonical(ref, meter)
        order = state.order
        if ref in order and tuple(order[: order.index(ref)]) == tuple(context):
            before = [self._anchor_kv, *(self._placed_kv(r, meter) for r in context)]
            start = self._starts(order)[ref]
        else:  # an off-window context (a recall's original one): place it after the anchor
            before, start = [self._anchor_kv], self._anchor.advance
            for r in context:
                before.append(self._place(r, start, meter))
                start += self._entry(r).chunk.advance
        conditioned = self.backend.condition(entry.chunk, before, start)
        self._adopt(ref, tuple(context), canonical, conditioned, meter)

    def _form_run(self, refs: Sequence[ChunkRef], meter: CostMeter) -> None:
        """Patches for consecutive in-window chunks, each on everything to its left: one forward."""
        order, first = self._state.order, refs[0]
        canonicals = [self._canonical(ref, meter) for ref in refs]
        left = order[: order.index(first)]
        before = [self._anchor_kv, *(self._placed_kv(r, meter) for r in left)]
        chunks = [self._entry(ref).chunk for ref in refs]
        conditioned = self.backend.condition_run(chunks, before, self._starts(order)[first])
        for ref, canonical, kv in zip(refs, canonicals, conditioned, strict=True):
            self._adopt(ref, tuple(order[: order.index(ref)]), canonical, kv, meter)

    def _adopt(
        self,
        ref: ChunkRef,
        context: tuple[ChunkRef, ...],
        canonical: ChunkKV,
        conditioned: ChunkKV,
        meter: CostMeter,
    ) -> None:
        """Patch ``ref`` with the deficit of ``conditioned``: store it, fold it into the orbit."""
        ctx, entry = self._ctx(), self._entry(ref)
        patch = form_patch(
            canonical, conditioned, self.backend.layout, ctx.rank, antecedent=ctx.ordered(context)
        )
        self.store.put_patch(patch)
        meter.patches_formed += 1
        meter.bytes_added += patch.nbytes
        if self.config.orbit:
            self._update_orbit(ref, context, patch)
        entry.patch, entry.pending = patch, False
        self._state.set_encodes(ref, context)

    def _update_orbit(self, ref: ChunkRef, context: Sequence[ChunkRef], patch: Patch) -> None:
        """Fold this ordering's patch into the mean over its antecedent set's orderings."""
        ctx = self._ctx()
        key = ctx.unordered(context)
        orbit = self.store.get_patch(ref.key, key)
        members = json.loads(orbit.meta.get("members", "[]")) if orbit is not None else []
        if patch.antecedent in members:
            return
        if orbit is None:
            merged = merge_patches([patch], ctx.rank, antecedent=key)
        else:
            merged = merge_patches([orbit, patch], ctx.rank, weights=[len(members), 1], antecedent=key)
        self.store.put_patch(
            Patch(
                merged.factors,
                merged.num_tokens,
                merged.chunk_key,
                key,
                merged.model_fingerprint,
                "orbit",
                {"members": json.dumps([*members, patch.antecedent])},
            )
        )

    def _materialize(self, meter: CostMeter) -> None:
        """Form every patch that lazy timing deferred, left to right."""
        order = self._state.order
        for index, ref in enumerate(order):
            if self._state.entries[ref].pending:
                self._form(ref, tuple(order[:index]), meter)
                self._state.tick += 1  # the window's KV changed: answers computed before are stale

    def _canonical(self, ref: ChunkRef, meter: CostMeter) -> ChunkKV:
        entry = self._entry(ref)
        before = self.backend.counters.lm_forwards
        canonical = self.backend.encode(entry.chunk)
        if self.backend.counters.lm_forwards > before:
            meter.prefilled.add(ref)
            meter.bytes_added += canonical.nbytes
            meter.reencodes += int(entry.encoded)
        entry.encoded = True
        return canonical

    def _place(
        self, ref: ChunkRef, start: int, meter: CostMeter, patch: Patch | bool | None = True
    ) -> ChunkKV:
        entry = self._entry(ref)
        chosen = entry.patch if patch is True else patch
        canonical = self._canonical(ref, meter)
        return apply_patch(canonical, chosen or None, self.backend.layout, entry.chunk.positions_at(start))

    def _placed_kv(self, ref: ChunkRef, meter: CostMeter) -> ChunkKV:
        start, entry = self._starts(self._state.order)[ref], self._entry(ref)
        memo = self._placed.get(ref)
        if memo is not None and memo[0] == start and memo[1] == id(entry.patch):
            return memo[2]
        kv = self._place(ref, start, meter)
        self._placed[ref] = (start, id(entry.patch), kv)
        return kv

    def _placements(self, meter: CostMeter) -> list[ChunkKV]:
        return [self._anchor_kv, *(self._placed_kv(ref, meter) for ref in self._state.order)]

    def _view_without(self, removed: ChunkRef, order: Sequence[ChunkRef], meter: CostMeter) -> list[ChunkKV]:
        """Placements with ``removed`` left out and its conditioning taken off its dependents."""
        ctx, starts = self._ctx(), self._starts(order)
        placed = [self._anchor_kv]
        for index, ref in enumerate(order):
            patch: Patch | bool | None = True
            if removed in self._state.encodes(ref):
                patch = self.store.get_patch(ref.key, ctx.ordered(order[:index])) if index else None
            placed.append(self._place(ref, starts[ref], meter, patch))
        return placed

    def _answer(self, query: str, config: DecodeConfig, meter: CostMeter) -> Answer:
        self._materialize(meter)
        return self._decode(self._placements(meter), self._state.order, query, config)

    def _decode(
        self, placed: list[ChunkKV], order: Sequence[ChunkRef], query: str, config: DecodeConfig
    ) -> Answer:
        query_ids = self._encoder.query_ids(query)
        end = self._anchor.advance + sum(self._entry(r).chunk.advance for r in order)
        limit = _context_length(self.backend)
        needed = end + int(query_ids.shape[0]) + config.max_new_tokens
        if limit is not None and needed > limit:
            raise ContextOverflowError(
                f"window ({end} positions) + query ({query_ids.shape[0]} tokens) + answer "
                f"({config.max_new_tokens}) needs {needed} positions; the model has {limit}. Slide or evict "
                "chunks, or shorten the query"
            )
        return self.backend.decode(self.backend.assemble(placed), query_ids, end, config)


def _context_length(backend: Backend) -> int | None:
    model = getattr(backend, "model", None)
    if model is None:
        return None
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if value else None
