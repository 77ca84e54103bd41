"""Planning window operations: the new order, evictions, admissions and per-chunk steps.

Why separate from execution: ``window.plan(op)`` must be a true dry run, so every op is first
turned into a `WindowPlan` without touching state (the per-chunk rule lives in
`kamera_agent.window.planner.decide`), then executed by `kamera_agent.window.execution`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.errors import CapacityError, ChunkInWindowError, DuplicateChunkError, UnknownChunkError
from kamera_agent.policies import EVICTION, PATCH_TIMING, REORDER, SURVIVORS, EvictionContext, PatchAction
from kamera_agent.window.base import WindowCore
from kamera_agent.window.planner import Step, WindowPlan, decide
from kamera_agent.window.state import ChunkRef

__all__ = ["PlanningMixin"]


class PlanningMixin(WindowCore):
    """Builds `WindowPlan` objects for push, reorder, slide/evict and recall."""

    def _plan_push(self, chunk: Chunk, label: str | None) -> WindowPlan:
        state = self._state
        ref = ChunkRef(state.next_id, chunk.key, label or f"{chunk.kind}-{state.next_id}", state.lineage)
        evicted = self._make_room(chunk.num_tokens, keep=())
        survivors = [r for r in state.order if r not in evicted]
        order = (*survivors, ref)
        steps = self._survivor_steps(survivors, SURVIVORS[self.config.survivors], full=order)
        steps.append(Step("encode", ref, detail=self._encode_detail(chunk)))
        steps.append(self._new_chunk_step(ref, tuple(survivors), PATCH_TIMING[self.config.patch_mode]))
        return WindowPlan("push", order, tuple(evicted), (ref,), tuple(steps), {ref: chunk})

    def _plan_reorder(self, refs: Sequence[ChunkRef]) -> WindowPlan:
        order = tuple(self._in_window(ref) for ref in refs)
        if len(set(order)) != len(order):
            duplicate = next(ref for ref in order if order.count(ref) > 1)
            raise DuplicateChunkError(f"{duplicate} appears twice in the new order; name each chunk once")
        missing = [ref for ref in self._state.order if ref not in order]
        if missing:
            raise UnknownChunkError(
                f"reorder needs every in-window chunk; missing {missing}. Evict chunks first to drop them"
            )
        fallback = REORDER[self.config.reorder]
        steps = [decide(self._state, self._ctx(), ref, order, fallback) for ref in order]
        return WindowPlan("reorder", order, steps=tuple(self._drop_idle(steps, order)))

    def _plan_remove(self, refs: Sequence[ChunkRef], op: str) -> WindowPlan:
        order = tuple(r for r in self._state.order if r not in refs)
        steps = self._survivor_steps(order, SURVIVORS[self.config.survivors])
        return WindowPlan(op, order, tuple(refs), steps=tuple(steps))

    def _plan_recall(self, ref: ChunkRef, at: int | None = None) -> WindowPlan:
        entry = self._entry(ref)
        if entry.in_window:
            raise ChunkInWindowError(f"{ref} is already in the window; reorder it instead of recalling it")
        evicted = self._make_room(entry.chunk.num_tokens, keep=(ref,))
        survivors = [r for r in self._state.order if r not in evicted]
        index = len(survivors) if at is None else at
        if not 0 <= index <= len(survivors):
            raise ValueError(f"recall at={at} is outside the window's 0..{len(survivors)} slots")
        order = (*survivors[:index], ref, *survivors[index:])
        steps = self._survivor_steps(order[:index], SURVIVORS[self.config.survivors], full=order)
        steps.append(Step("encode", ref, detail=self._encode_detail(entry.chunk)))
        steps.append(self._recall_step(ref, order, index))
        follow: PatchAction = "form" if self.config.cascade == "cascade" else "keep"
        later = [decide(self._state, self._ctx(), r, order, follow) for r in order[index + 1 :]]
        steps += self._drop_idle(later, order)
        return WindowPlan("recall", order, tuple(evicted), (ref,), tuple(steps))

    def _recall_step(self, ref: ChunkRef, order: Sequence[ChunkRef], index: int) -> Step:
        ctx, entry = self._ctx(), self._entry(ref)
        left = tuple(order[:index])
        context, why = left, "patch on the chunks now to its left"
        if self.config.recall_context == "original":
            context, why = entry.home, "patch on its original earlier context"
            if set(entry.home) & set(order[index + 1 :]):
                context, why = left, "its earlier context is now to its right: patch on its new left"
        if ctx.rank == 0:
            return Step("revert" if entry.patch is not None else "rotate", ref, detail="blind reuse")
        if not context:
            return Step("revert", ref, detail="its context was empty: served as its canonical")
        if self._state.encodes(ref) == context and entry.patch is not None and not entry.pending:
            return Step("rotate", ref, context, detail=f"keeps its stored {why}")
        if ctx.has_patch(ref.key, ctx.ordered(context)):
            return Step("apply_patch", ref, context, ctx.ordered(context), f"stored {why}")
        return Step("form_patch", ref, context, detail=why)

    def _new_chunk_step(self, ref: ChunkRef, left: tuple[ChunkRef, ...], action: PatchAction) -> Step:
        ctx = self._ctx()
        if ctx.rank == 0 or not left:
            return Step("rotate", ref, detail="canonical is exact here" if left == () else "blind reuse")
        if ctx.has_patch(ref.key, ctx.ordered(left)):
            return Step("apply_patch", ref, left, ctx.ordered(left), "stored patch for this left context")
        if action == "form":
            return Step("form_patch", ref, left, detail="conditioned on its left context")
        return Step("defer" if action == "defer" else "revert", ref, detail=f"patch timing: {action}")

    def _survivor_steps(
        self, order: Sequence[ChunkRef], action: PatchAction, full: Sequence[ChunkRef] | None = None
    ) -> list[Step]:
        layout = full or order
        steps = [decide(self._state, self._ctx(), ref, layout, action) for ref in order]
        return self._drop_idle(steps, layout)

    def _drop_idle(self, steps: list[Step], order: Sequence[ChunkRef]) -> list[Step]:
        """Rotations of chunks whose start does not move are no edit at all."""
        before, after = self._starts(self._state.order), self._starts(order)
        return [s for s in steps if s.kind != "rotate" or before.get(s.ref) != after.get(s.ref)]

    def _make_room(self, tokens: int, keep: Sequence[ChunkRef]) -> list[ChunkRef]:
        cap_chunks, cap_tokens = self.config.capacity_chunks, self.config.capacity_tokens
        if cap_tokens is not None and tokens > cap_tokens:
            raise CapacityError(
                f"a chunk of {tokens} tokens can never fit capacity_tokens={cap_tokens}; raise the capacity"
            )
        order = [r for r in self._state.order if r not in keep]
        used = sum(self._entry(r).chunk.num_tokens for r in order)
        last = self._state.last_answer
        probe_kl = None
        if last is not None:  # the probe-driven policy scores chunks against the last query
            query = last[0]
            probe_kl = lambda ref: self.probe_kl(ref, query)  # noqa: E731
        context = EvictionContext(order, {r: self._entry(r).last_used for r in order}, probe_kl)
        evicted: list[ChunkRef] = []
        for candidate in EVICTION[self.config.eviction](context):
            over_chunks = cap_chunks is not None and len(order) - len(evicted) + 1 > cap_chunks
            over_tokens = cap_tokens is not None and used + tokens > cap_tokens
            if not (over_chunks or over_tokens):
                break
            evicted.append(candidate)
            used -= self._entry(candidate).chunk.num_tokens
        return evicted

    def _encode_detail(self, chunk: Chunk) -> str:
        if self.store.has_canonical(chunk.key):
            return "canonical from the store (no forward)"
        return "prefill behind the anchor (vision output from the store)" if chunk.has_vision else "prefill"
