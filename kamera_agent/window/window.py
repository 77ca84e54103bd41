"""KameraWindow: the deque of chunks an agent's model attends to, edited without re-prefill.

    window = KameraWindow(model, processor)
    frame = window.push(image)            # encode once (store hit: free), patch on its left context
    window.slide()                        # oldest leaves; survivors only rotate
    window.recall(frame)                  # back from the store: rotation + its stored patch
    answer = window.ask("What changed?")  # anchor + relocated, patched chunks -> decode

Every operation is planned first (`kamera_agent.window.planner`), then executed as cache edits;
its cost lands in ``window.stats``. A failed operation restores the window as it was.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import torch
from PIL import Image

from kamera_agent.backends.base import Backend, DecodeConfig
from kamera_agent.chunks.chunk import Chunk, ChunkKind
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.chunks.sources import ChannelOrder, VideoFrame
from kamera_agent.config import WindowConfig
from kamera_agent.errors import (
    CapacityError,
    ChunkInWindowError,
    ContextOverflowError,
    DuplicateChunkError,
    UnknownChunkError,
    UnreadableInputError,
)
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.operator.patch import Patch, apply_patch, form_patch, merge_patches
from kamera_agent.policies import EVICTION, PATCH_TIMING, REORDER, SURVIVORS, EvictionContext, PatchAction
from kamera_agent.results import Answer, OpCost, Plan, Probe, WindowStats
from kamera_agent.settings import configure_threads
from kamera_agent.store import ChunkStore
from kamera_agent.window.costs import CostMeter, StatsBook
from kamera_agent.window.planner import PlanContext, Step, WindowPlan, decide
from kamera_agent.window.state import ChunkRef, Entry, WindowState

__all__ = ["KameraWindow"]

Item = Chunk | str | Image.Image | np.ndarray | Path | VideoFrame


class KameraWindow:
    """A window of chunks over one model, with position-free reuse of every chunk's KV.

    Args:
        model: a loaded transformers model, a local checkpoint path, or a `Backend`.
        processor: the model's processor, if it has a full one.
        tokenizer: the tokenizer, when no processor is given.
        image_processor: the image processor, when no processor is given (VLMs).
        config: how the window behaves (`WindowConfig`); default ``WindowConfig()``.
        store: a `ChunkStore` to share between windows of the same model.
    """

    def __init__(
        self,
        model: Any,
        processor: Any | None = None,
        *,
        tokenizer: Any | None = None,
        image_processor: Any | None = None,
        config: WindowConfig | None = None,
        store: ChunkStore | None = None,
    ) -> None:
        self.config = config or WindowConfig()
        if self.config.threads is not None:
            configure_threads(self.config.threads)
        self.backend = _resolve_backend(model, processor, tokenizer, image_processor, self.config, store)
        self._state = WindowState()
        self._book = StatsBook()
        self._placed: dict[ChunkRef, tuple[int, int, ChunkKV]] = {}

    # -- reading the window ----------------------------------------------------------------
    @property
    def refs(self) -> list[ChunkRef]:
        """The chunks in the window, left to right."""
        return list(self._state.order)

    @property
    def evicted(self) -> list[ChunkRef]:
        """Chunks that left the window and can be recalled."""
        return [ref for ref, entry in self._state.entries.items() if not entry.in_window]

    def __len__(self) -> int:
        return len(self._state.order)

    def chunk(self, ref: ChunkRef) -> Chunk:
        """The model-ready chunk behind a ref."""
        return self._entry(ref).chunk

    def patch_of(self, ref: ChunkRef) -> Patch | None:
        """The patch ``ref``'s KV carries now (``None``: the canonical alone)."""
        return self._entry(ref).patch

    @property
    def graph(self) -> nx.DiGraph:
        """The antecedent graph (edge A→B: B's KV encodes A), as a frozen copy.

        Nodes are every chunk ever admitted, with ``in_window`` and ``label`` attributes.
        """
        graph = self._state.graph.copy()
        for ref, entry in self._state.entries.items():
            graph.nodes[ref].update(in_window=entry.in_window, label=ref.label)
        return nx.freeze(graph)

    @property
    def stats(self) -> WindowStats:
        """Per-op and cumulative costs."""
        return self._book.snapshot()

    @property
    def store(self) -> ChunkStore:
        """The content-addressed store of canonicals, vision outputs and patches."""
        return self.backend.store

    # -- operations -------------------------------------------------------------------------
    def push(
        self,
        item: Item,
        *,
        label: str | None = None,
        kind: ChunkKind | None = None,
        caption: str | None = None,
        channel_order: ChannelOrder | None = None,
    ) -> ChunkRef:
        """Admit an image, frame, screenshot, page, text or `Chunk` at the right end.

        A content-key hit reuses the stored canonical (no vision, no prefill) and any stored
        patch for the same antecedents. Over capacity, the eviction policy makes room first.

        Mutates: the window (admits one chunk, may evict), the store (canonical, patch).
        """
        chunk = self._chunk_of(item, kind, caption, channel_order, label)
        plan = self._plan_push(chunk, label)
        self._transact(plan)
        return plan.admitted[0]

    def reorder(self, refs: Sequence[ChunkRef]) -> None:
        """Put the window's chunks in a new order (a permutation of `refs`).

        Each chunk relocates by rotation; one whose antecedent sequence changed is served by
        its orbit patch (same set), a stored patch, or the reorder policy.

        Mutates: the window's order and patches; the store (patches formed).
        """
        self._transact(self._plan_reorder(refs))

    def slide(self, n: int = 1) -> list[ChunkRef]:
        """Evict the ``n`` leftmost chunks; returns them. Survivors only rotate (by default).

        Mutates: the window.
        """
        if n < 0:
            raise ValueError(f"slide needs n >= 0, got {n}")
        plan = self._plan_remove(self._state.order[:n], "slide")
        self._transact(plan)
        return list(plan.evicted)

    def evict(self, ref: ChunkRef) -> None:
        """Take one chunk out of the window (its canonical and patches stay: recallable).

        Mutates: the window.
        """
        self._in_window(ref)
        self._transact(self._plan_remove([ref], "evict"))

    def recall(self, ref: ChunkRef, at: int | None = None) -> ChunkRef:
        """Re-admit an evicted chunk at index ``at`` (default: the right end).

        No vision re-encode while its canonical is stored. Its patch comes from its original
        earlier context (default: stored at admission, so free) or the chunks now left of it;
        chunks after it are re-patched in order (``cascade``) or kept, as the plan says.

        Mutates: the window, the store (patches formed).
        """
        self._transact(self._plan_recall(ref, at))
        return ref

    def ask(
        self,
        query: str,
        *,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        return_logits: bool = False,
    ) -> Answer:
        """Answer ``query`` over the window: greedy by default, sampled with a temperature."""
        config = DecodeConfig(
            max_new_tokens or self.config.max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            tuple(stop),
            return_logits,
        )
        meter = CostMeter(self.backend.counters)
        answer = self._answer(query, config, meter)
        cost = meter.finish()
        self._book.record("ask", cost)
        return _with_cost(answer, cost)

    def probe_without(self, ref: ChunkRef, query: str, *, max_new_tokens: int = 8) -> Probe:
        """Is ``ref`` still load-bearing for ``query``? Decode with its influence switched off.

        The chunk is left out and the chunks whose KV encodes it are served without that
        conditioning (a stored patch for their reduced context, else their canonical): one
        decode each way, no re-prefill, and the window is unchanged afterwards.
        """
        self._in_window(ref)
        config = DecodeConfig(max_new_tokens=max_new_tokens)
        meter = CostMeter(self.backend.counters)
        with_chunk = self._answer(query, config, meter)
        order = [r for r in self._state.order if r != ref]
        placed = self._view_without(ref, order, meter)
        without = self._decode(placed, order, query, config)
        kl = _kl(with_chunk.first_logits, without.first_logits)
        agree = int(with_chunk.first_logits.argmax()) == int(without.first_logits.argmax())
        cost = meter.finish()
        self._book.record("probe", cost)
        return Probe(with_chunk, without, kl, agree, kl < self.config.probe_threshold, cost)

    def fork(self) -> KameraWindow:
        """A copy-on-write branch: it shares canonicals and patches; edits stay in their branch."""
        branch = object.__new__(KameraWindow)
        branch.config = self.config
        branch.backend = self.backend
        branch._state = self._state.copy()
        branch._book = self._book.copy()
        branch._placed = dict(self._placed)
        return branch

    def plan(self, op: str, *args: Any, **kwargs: Any) -> Plan:
        """Dry run: the edits ``op`` ("push", "reorder", "slide", "evict", "recall") would do.

        Predicted forwards count a chunk encode only when its canonical is not stored.
        """
        builders: dict[str, Callable[..., WindowPlan]] = {
            "push": lambda item, label=None, **kw: self._plan_push(
                self._chunk_of(item, label=label, **kw), label
            ),
            "reorder": self._plan_reorder,
            "slide": lambda n=1: self._plan_remove(self._state.order[:n], "slide"),
            "evict": lambda ref: self._plan_remove([self._in_window(ref)], "evict"),
            "recall": self._plan_recall,
        }
        if op not in builders:
            raise ValueError(f"unknown op {op!r}; plan one of {', '.join(builders)}")
        plan = builders[op](*args, **kwargs)
        chunks = {**{r: e.chunk for r, e in self._state.entries.items()}, **plan.chunks}
        tokens = {ref: chunk.num_tokens for ref, chunk in chunks.items()}
        forwards = {ref: 0 if self.store.has_canonical(chunk.key) else 1 for ref, chunk in chunks.items()}
        forwards |= {step.ref: 1 for step in plan.steps if step.kind == "form_patch"}
        return plan.public(forwards, tokens)

    def kv(self) -> Any:
        """The assembled cache of the window (anchor + placed chunks), as the backend holds it."""
        meter = CostMeter(self.backend.counters)
        self._materialize(meter)
        return self.backend.assemble(self._placements(meter))

    def as_model_inputs(self, query: str | None = None) -> dict[str, Any]:
        """Keyword arguments for the model's own forward over a full re-prefill of the window
        (input ids, pixel values, grids, token types): the ground truth for exactness checks."""
        chunks = [self._state.entries[ref].chunk for ref in self._state.order]
        query_ids = None if query is None else self._encoder.query_ids(query)
        return self.backend.reference_inputs(chunks, query_ids)

    # -- planning ---------------------------------------------------------------------------
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
            return Step("revert", ref, detail="no earlier context: the canonical is exact")
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
        context = EvictionContext(order, {r: self._entry(r).last_used for r in order})
        evicted: list[ChunkRef] = []
        for candidate in EVICTION[self.config.eviction](context):
            over_chunks = cap_chunks is not None and len(order) - len(evicted) + 1 > cap_chunks
            over_tokens = cap_tokens is not None and used + tokens > cap_tokens
            if not (over_chunks or over_tokens):
                break
            evicted.append(candidate)
            used -= self._entry(candidate).chunk.num_tokens
        return evicted

    def _ctx(self) -> PlanContext:
        return PlanContext(
            self._anchor.key, self.config.effective_rank, self.config.orbit, self.store.has_patch
        )

    def _encode_detail(self, chunk: Chunk) -> str:
        if self.store.has_canonical(chunk.key):
            return "canonical from the store (no forward)"
        return "prefill behind the anchor (vision output from the store)" if chunk.has_vision else "prefill"

    # -- execution --------------------------------------------------------------------------
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
        for step in plan.steps:
            self._apply(step, meter)

    def _apply(self, step: Step, meter: CostMeter) -> None:
        entry, state, n = self._state.entries[step.ref], self._state, self._entry(step.ref).chunk.num_tokens
        if step.kind == "encode":
            self._canonical(step.ref, meter)
        elif step.kind == "rotate":
            meter.tokens_reused += n
        elif step.kind == "apply_patch":
            patch = self.store.get_patch(step.ref.key, step.signature)
            if patch is None:  # dropped from the store since planning: form it instead
                self._form(step.ref, step.antecedents, meter)
                return
            entry.patch, entry.pending = patch, False
            state.set_encodes(step.ref, step.antecedents)
            meter.patches_applied += 1
            meter.tokens_reused += n
        elif step.kind == "form_patch":
            self._form(step.ref, step.antecedents, meter)
        else:  # revert, defer
            entry.patch, entry.pending = None, step.kind == "defer"
            state.set_encodes(step.ref, ())
            meter.tokens_reused += n

    def _form(self, ref: ChunkRef, context: Sequence[ChunkRef], meter: CostMeter) -> None:
        """One conditioned forward of ``ref`` over ``context`` → patch (stored, orbit updated)."""
        state, entry, ctx = self._state, self._entry(ref), self._ctx()
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
        signature = ctx.ordered(context)
        patch = form_patch(canonical, conditioned, self.backend.layout, ctx.rank, antecedent=signature)  # type: ignore[arg-type]
        self.store.put_patch(patch)
        meter.patches_formed += 1
        meter.bytes_added += patch.nbytes
        if self.config.orbit:
            self._update_orbit(ref, context, patch)
        entry.patch, entry.pending = patch, False
        state.set_encodes(ref, tuple(context))

    def _update_orbit(self, ref: ChunkRef, context: Sequence[ChunkRef], patch: Patch) -> None:
        """Fold this ordering's patch into the mean over its antecedent set's orderings."""
        ctx = self._ctx()
        key = ctx.unordered(context)
        orbit = self.store.get_patch(ref.key, key)
        members = json.loads(orbit.meta.get("members", "[]")) if orbit is not None else []
        if patch.antecedent in members:
            return
        if orbit is None:
            merged = merge_patches([patch], ctx.rank, antecedent=key)  # type: ignore[arg-type]
        else:
            merged = merge_patches([orbit, patch], ctx.rank, weights=[len(members), 1], antecedent=key)  # type: ignore[arg-type]
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

    # -- placement ----------------------------------------------------------------------------
    @property
    def _anchor(self) -> Chunk:
        return self.backend.anchor

    @property
    def _anchor_kv(self) -> ChunkKV:
        return self.backend.anchor_kv()

    @property
    def _encoder(self) -> ChunkEncoder:
        return self.backend.encoder

    def _starts(self, order: Sequence[ChunkRef]) -> dict[ChunkRef, int]:
        """Where each chunk starts: positions follow from the order, never stored."""
        starts, position = {}, self._anchor.advance
        for ref in order:
            starts[ref] = position
            entry = self._state.entries.get(ref)
            position += entry.chunk.advance if entry is not None else 0  # a chunk being admitted: last
        return starts

    def _end(self) -> int:
        return self._anchor.advance + sum(self._entry(r).chunk.advance for r in self._state.order)

    def _canonical(self, ref: ChunkRef, meter: CostMeter) -> ChunkKV:
        entry = self._entry(ref)
        before = self.backend.counters.lm_forwards
        canonical = self.backend.encode(entry.chunk)
        if self.backend.counters.lm_forwards > before:
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

    # -- answering ----------------------------------------------------------------------------
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

    # -- validation ---------------------------------------------------------------------------
    def _entry(self, ref: ChunkRef) -> Entry:
        if not isinstance(ref, ChunkRef):
            raise UnknownChunkError(f"expected a ChunkRef from this window, got {type(ref).__name__}")
        if ref.lineage != self._state.lineage or ref not in self._state.entries:
            raise UnknownChunkError(f"{ref} does not belong to this window (another window's ref?)")
        return self._state.entries[ref]

    def _in_window(self, ref: ChunkRef) -> ChunkRef:
        if not self._entry(ref).in_window:
            raise UnknownChunkError(f"{ref} is not in the window (evicted); recall it first")
        return ref

    def _chunk_of(
        self,
        item: Item,
        kind: ChunkKind | None = None,
        caption: str | None = None,
        channel_order: ChannelOrder | None = None,
        label: str | None = None,
    ) -> Chunk:
        encoder = self._encoder
        if isinstance(item, Chunk):
            return item
        if isinstance(item, str):
            return encoder.text(item, label=label)
        if isinstance(item, VideoFrame):
            meta = {"frame": str(item.index), "seconds": f"{item.seconds:.3f}"}
            return encoder.image(item.image, kind=kind or "frame", caption=caption, label=label, meta=meta)
        if isinstance(item, Image.Image | np.ndarray | Path):
            return encoder.image(
                item, kind=kind or "image", caption=caption, channel_order=channel_order, label=label
            )
        raise UnreadableInputError(
            f"cannot push a {type(item).__name__}; push a PIL image, an array (with channel_order), "
            "a Path to an image, a VideoFrame, text (str) or a Chunk"
        )


def _resolve_backend(
    model: Any,
    processor: Any | None,
    tokenizer: Any | None,
    image_processor: Any | None,
    config: WindowConfig,
    store: ChunkStore | None,
) -> Backend:
    from kamera_agent.loading import load_backend

    if isinstance(model, Backend):
        return model
    dtype = getattr(torch, config.dtype) if config.dtype is not None else None
    if not isinstance(model, str | Path):
        if config.device is not None:
            model = model.to(torch.device(config.device))
        if dtype is not None:
            model = model.to(dtype)
    backend = load_backend(
        model,
        processor,
        tokenizer=tokenizer,
        image_processor=image_processor,
        dtype=dtype,
        device=config.device,
        store=store,
    )
    if store is None and (
        config.disk_dir is not None or config.memory_budget != backend.store.stats().memory_budget
    ):
        backend.store = ChunkStore(
            fingerprint=backend.fingerprint,
            memory_budget=config.memory_budget,
            disk_dir=config.disk_dir,
            disk_budget=config.disk_budget,
        )
    return backend


def _context_length(backend: Backend) -> int | None:
    model = getattr(backend, "model", None)
    if model is None:
        return None
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if value else None


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def _with_cost(answer: Answer, cost: OpCost) -> Answer:
    from dataclasses import replace

    return replace(answer, cost=cost)
