"""The per-chunk rules of planning: which edit one chunk needs at its place in the new order.

Why a module of its own: the planner walks an operation's new order left to right, chaining
the planned states of the chunks to the left into a `Context`; at each chunk it asks these
rules, which read only the chunk's state, that context and a read-only store view:

0. blind reuse (rank 0) → the canonical, except a recomputed state over the same left (a drift
   budget's repair stays);
1. its state's context is the planned left context → **rotate** only (relocation is exact);
2. first in the window → **revert** to the canonical (exact there); a survivor that keeps what
   it absorbed stays as it is where no canonical is stored, except under an answer budget: the
   lead is the attention sink, what it absorbed moves every answer;
3. its left context is what it was before this op and it encodes nothing now at or right of
   it → **rotate**: the op did not touch what it depends on; under the keep policy and a drift
   budget also where what it encodes at or right of it was not to its left before the op (a
   recalled chunk it absorbed before that chunk left): its KV and what it sees are as they
   were (`Rules.stands`);
4. a patch (or full KV) stored for the state it would have over the planned left context →
   **apply** it (exact for this ordering, so it comes before the orbit);
5. same antecedent *set*, other order, orbit patches on, an orbit patch stored → **apply** it;
6. otherwise the op's policy: **form** a patch (one conditioned forward), **keep** the old one
   (only while causal), **revert** to the canonical, or **defer** (lazy).

Lookups in 4-5 go by chained state, so a patch formed over antecedents that encode something
else (a survivor of a slide, an approximate patch, another window's history) is never found
where other antecedents stand. The pushed and the recalled chunk have rules of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.config import WindowConfig
from kamera_agent.core.identity import (
    ChunkState,
    Context,
    StateRank,
    effective_rank,
    orbit_key,
    patched_digest,
)
from kamera_agent.core.recompute import selected_count
from kamera_agent.core.staging import StoreView, can_form
from kamera_agent.fidelity import DriftBudget
from kamera_agent.policies import PATCH_TIMING, PatchAction
from kamera_agent.results import EditKind
from kamera_agent.window.plan import Step
from kamera_agent.window.state import ChunkRef, WindowRecord

__all__ = ["Causality", "LeftContexts", "PlanInputs", "Rules"]


@dataclass(frozen=True)
class PlanInputs:
    """What planning reads besides the window state, all of it read-only.

    Attributes:
        config: the window's settings.
        view: presence of store entries and stored patches' states (no loads, no counts).
        root: the context every window of this model and anchor starts behind.
        features: the widest KV slot (heads · dim): a rank at or above it is lossless.
        kv_bytes_per_token: bytes of one token's canonical, for budget checks.
        query_tokens: how many tokens a query has (probe edits' cost).
        gaps: the engine runs formations with placed chunks between them in one forward
            (`Backend.supports_gaps`).
        budget: the window's drift budget (``None``: none), for the never-costlier bound on
            what keeping it may re-prefill.
    """

    config: WindowConfig
    view: StoreView
    root: Context
    features: int
    kv_bytes_per_token: int
    query_tokens: Callable[[str], int] = lambda query: 0
    gaps: bool = False
    budget: DriftBudget | None = None


Causality = Callable[[ChunkRef, int], bool]
"""Whether the chunk at index ``i`` encodes nothing now at or right of it."""


LeftContexts = Callable[[], dict[ChunkRef, str]]
"""Each chunk's left context before the op, by digest: computed the first time a rule asks
(only some chunks' rules need them)."""


class Rules:
    """The rules above, for one planner's inputs (`PlanInputs`)."""

    def __init__(self, inputs: PlanInputs) -> None:
        self.inputs, self.config, self.view, self.root = inputs, inputs.config, inputs.view, inputs.root
        self.rank = inputs.config.effective_rank

    def decide(
        self,
        state: WindowRecord,
        ref: ChunkRef,
        i: int,
        order: Sequence[ChunkRef],
        causal: Causality,
        ctx: Context,
        before: LeftContexts,
        action: PatchAction,
    ) -> Step:
        """The edit an in-window chunk needs at index ``i`` behind ``ctx`` (the module's rules)."""
        entry = state.entries[ref]
        current, chunk = entry.state, entry.chunk
        if self.rank == 0 and not (current.kind == "recomputed" and current.context.digest == ctx.digest):
            kind: EditKind = "rotate" if current.kind == "canonical" else "revert"
            return self.canonical_step(kind, ref, "blind reuse: relocation only")
        if entry.pending:
            return Step("defer", ref, self.canonical(ref), detail="patch still due (lazy)")
        if current.kind != "orbit" and current.context.digest == ctx.digest:
            # The chunks to its left hold exactly the states it encodes (with repeated content,
            # maybe other refs than before): its edges follow them.
            return Step(
                "rotate", ref, current, tuple(order[:i]), detail="antecedents unchanged: relocation only"
            )
        if i == 0:
            as_is = action == "keep" and (causal(ref, i) or self.stands(state, ref, i, order))
            if as_is and self.config.answer_budget is None and not self.view.has_canonical(ref.key):
                return Step("rotate", ref, current, detail="first in the window, keeps what it absorbed")
            return self.canonical_step("revert", ref, "first in the window: the canonical is exact")
        if before().get(ref) == ctx.digest:
            alone = self.left_alone(state, ref, i, order, causal(ref, i), action == "keep")
            if alone is not None:
                return alone
        stored = self.stored(ref, chunk, ctx, order[:i], "for these antecedents")
        if stored is not None:  # exact for this ordering: before the orbit's mean over orderings
            return stored
        rank = self.rank_of(chunk)
        same_set = current.keyset == ctx.keyset and (current.kind == "orbit" or current.context.length == i)
        if self.config.orbit and current.kind != "canonical" and same_set:
            # At the chunk's rank, else its full-rank orbit: the mean of the exact KVs its
            # orderings were formed with where no canonical was stored (formation).
            ranks: tuple[StateRank, ...] = (rank, "full") if rank != "full" else ("full",)
            for orbit_rank in ranks:
                address = orbit_key(ref.key, orbit_rank, self.root, ctx)
                orbit = self.stored_orbit(ref.key, orbit_rank, address, ctx.keyset)
                if orbit is not None:
                    detail = "same antecedent set: orbit patch"
                    return self.with_canonical(
                        Step("apply_patch", ref, orbit, tuple(order[:i]), address, detail=detail)
                    )
        if action == "keep":
            if causal(ref, i):
                return Step("rotate", ref, current, detail="keeps its patch (policy: keep)")
            return self.formation(ref, chunk, ctx, order[:i], "its patch encodes a chunk now to its right")
        if action == "revert":
            return self.canonical_step("revert", ref, "no stored patch fits (policy: revert)")
        if action == "defer":
            return Step("defer", ref, self.canonical(ref), detail="patch formed before the next read (lazy)")
        return self.formation(ref, chunk, ctx, order[:i], "conditioned forward over its new left context")

    def pushed(self, ref: ChunkRef, chunk: Chunk, i: int, order: Sequence[ChunkRef], ctx: Context) -> Step:
        if self.rank == 0:
            return self.canonical_step("rotate", ref, "blind reuse")
        if i == 0:
            return self.canonical_step("rotate", ref, "first in the window: its canonical is exact here")
        stored = self.stored(ref, chunk, ctx, order[:i], "for this left context")
        if stored is not None:
            return stored
        action = PATCH_TIMING[self.config.patch_mode]
        if action == "form":
            return self.formation(
                ref, chunk, ctx, order[:i], "conditioned on its left context", admission=True
            )
        if action == "defer":
            return Step("defer", ref, self.canonical(ref), detail="patch timing: lazy")
        return self.canonical_step("revert", ref, f"patch timing: {self.config.patch_mode}")

    def recalled(
        self, state: WindowRecord, ref: ChunkRef, i: int, order: Sequence[ChunkRef], ctx: Context
    ) -> Step:
        entry = state.entries[ref]
        if self.rank == 0:
            return self.canonical_step("revert", ref, "blind reuse")
        original, why = entry.original, "patch on the chunks now to its left"
        if self.config.recall_context == "original" and original is not None:
            if original.state.kind == "canonical":
                return self.canonical_step("revert", ref, "its context was empty: served as its canonical")
            later = set(order[i + 1 :])
            if any(r in later for r in original.refs):
                why = "its earlier context is now to its right: patch on its new left"
            elif self.has(ref, original.state):
                detail = "its stored KV over its original earlier context"
                step = Step(
                    "apply_patch", ref, original.state, original.refs, original.state.digest, detail=detail
                )
                return self.with_canonical(step)
            else:
                cost = self.rebuild_cost(state, original.state.context)
                if cost is not None:
                    forwards, tokens = cost[0] + 1, cost[1] + entry.chunk.num_tokens
                    detail = "patch on its original earlier context"
                    step = Step(
                        "form_patch",
                        ref,
                        original.state,
                        original.refs,
                        off_window=True,
                        forwards=forwards,
                        tokens=tokens,
                        detail=detail,
                    )
                    return self.with_canonical(step)
                why = "its original context can no longer be rebuilt: patch on the chunks now to its left"
        if i == 0:
            return self.canonical_step("revert", ref, "first in the window: the canonical is exact")
        stored = self.stored(ref, entry.chunk, ctx, order[:i], why.replace("patch on", "for"))
        if stored is not None:
            return stored
        return self.formation(ref, entry.chunk, ctx, order[:i], why)

    def formed(
        self, state: WindowRecord, ref: ChunkRef, i: int, order: Sequence[ChunkRef], ctx: Context, why: str
    ) -> Step:
        """A pending chunk's patch over its left context, now (or the canonical at the front)."""
        if i == 0 or self.rank == 0:
            return self.canonical_step("revert", ref, f"{why}: first in the window, the canonical")
        chunk = state.entries[ref].chunk
        stored = self.stored(ref, chunk, ctx, order[:i], why)
        if stored is not None:
            return stored
        return self.formation(ref, chunk, ctx, order[:i], why, admission=True)

    # -- pieces -------------------------------------------------------------------------------
    def left_alone(
        self,
        state: WindowRecord,
        ref: ChunkRef,
        i: int,
        order: Sequence[ChunkRef],
        causal: bool,
        by_policy: bool,
    ) -> Step | None:
        """Rule 3: a chunk whose left context the op left as it was keeps its KV, where it encodes
        nothing now at or right of it (``causal``) or where, under the keep policy (``by_policy``), it
        may stand (`stands`); else ``None``."""
        current = state.entries[ref].state
        if causal:
            return Step("rotate", ref, current, detail="this op left its left context as it was")
        if by_policy and self.stands(state, ref, i, order):
            detail = "its left context as it was; what it absorbed of a chunk now to its right stays"
            return Step("rotate", ref, current, detail=detail)
        return None

    def stands(self, state: WindowRecord, ref: ChunkRef, i: int, order: Sequence[ChunkRef]) -> bool:
        """Whether ``ref``, at index ``i`` of ``order`` and not causal there, may keep its KV as it
        is (policy: keep) under the window's drift budget, which judges it as any kept state: every
        chunk it encodes that is now at or right of it was not to its left before the op (one
        coming back from eviction, or one it already stood before).

        Why that is enough: its KV encodes those chunks as they were when it was formed over them
        (its state chains their states then); nothing this op does reaches it where its left
        context is unchanged, so what it carries is what was kept, and estimated, while they were
        away. Re-forming it would pay tokens a prefix cache does not, and its state, the chain of
        what it was formed over, stays what its KV encodes: no state can encode a state formed
        over it. A chunk that stood left of it and now stands right (content repeated in the
        window) would leave an edge naming the wrong chunk: that one is re-formed as before.
        """
        if self.inputs.budget is None:
            return False  # unbounded: what it carries would be estimated by nothing
        was = state.order.index(ref) if ref in state.order else -1
        left_before = set(state.order[: max(was, 0)])
        now_right = set(order[i:])
        return not any(source in left_before and source in now_right for source in state.graph._pred[ref])

    def stored(
        self, ref: ChunkRef, chunk: Chunk, ctx: Context, left: Sequence[ChunkRef], why: str
    ) -> Step | None:
        """A stored KV for the chunk over ``ctx``: its full KV there (exact), else a stored patch."""
        if self.view.has_full(ref.key, patched_digest(ref.key, "full", ctx)):
            full = ChunkState.patched(ref.key, "full", ctx)
            return Step("apply_patch", ref, full, tuple(left), full.digest, detail=f"stored exact KV {why}")
        rank = self.rank_of(chunk)
        if rank == "full" or not self.view.has_patch(ref.key, patched_digest(ref.key, rank, ctx)):
            return None
        target = ChunkState.patched(ref.key, rank, ctx)
        step = Step("apply_patch", ref, target, tuple(left), target.digest, detail=f"stored patch {why}")
        return self.with_canonical(step)

    def formation(
        self,
        ref: ChunkRef,
        chunk: Chunk,
        ctx: Context,
        left: Sequence[ChunkRef],
        why: str,
        admission: bool = False,
    ) -> Step:
        """One conditioned forward over ``ctx``: the chunk's full KV where its rank is lossless or
        where its canonical is not stored; else a rank-m patch against its canonical.

        Why store the exact KV without a canonical: a rank-m patch needs the canonical, and
        forming that is a second forward over the chunk's tokens that no answer asked for (new
        content would prefill twice what a prefix cache does; a chunk re-formed after a reorder
        or a recall, twice what a re-prefill does). The exact KV costs the bytes the canonical
        would; once a canonical is stored (blind reuse, a revert, a probe formed it), later
        formations are compact rank-m patches against it.
        """
        rank = self.rank_of(chunk)
        if rank != "full" and not self.view.has_canonical(ref.key):
            reason = "new content" if admission else "no canonical stored"
            rank, why = "full", f"{why}; {reason}: its exact KV from this one forward"
        target = ChunkState.patched(ref.key, rank, ctx)
        step = Step("form_patch", ref, target, tuple(left), forwards=1, tokens=chunk.num_tokens, detail=why)
        return self.with_canonical(step)

    def refilled(self, ref: ChunkRef, chunk: Chunk, ctx: Context, left: Sequence[ChunkRef], why: str) -> Step:
        """The chunk as a re-prefill computes it over ``ctx``: its exact KV from the store when
        held, else from one forward (shared with the refilled chunks before it); first in the
        window, its canonical."""
        if ctx.length == 0:
            return self.canonical_step("revert", ref, f"{why}; first in the window: the canonical")
        full = ChunkState.patched(ref.key, "full", ctx)
        if self.view.has_full(ref.key, full.digest):
            return Step("apply_patch", ref, full, tuple(left), full.digest, detail=f"stored exact KV; {why}")
        return Step("form_patch", ref, full, tuple(left), forwards=1, tokens=chunk.num_tokens, detail=why)

    def canonical_step(self, kind: EditKind, ref: ChunkRef, why: str) -> Step:
        """The chunk served as its canonical (prefilled behind the anchor first, if not stored)."""
        return self.with_canonical(Step(kind, ref, self.canonical(ref), (), detail=why))

    def with_canonical(self, step: Step) -> Step:
        """Mark a step whose KV is built on the canonical when the store does not hold it."""
        step.needs_canonical = not step.state.is_full and not self.view.has_canonical(step.ref.key)
        return step

    def has(self, ref: ChunkRef, target: ChunkState) -> bool:
        """Whether the store holds what ``target`` is made of (a full KV, or a patch)."""
        if target.is_full:
            return self.view.has_full(ref.key, target.digest)
        return self.view.has_patch(ref.key, target.digest)

    def in_run(self, step: Step, previous: Step | None) -> Step:
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
        planned = step.state.context  # the window's chain up to here: ... then previous.state
        natural = previous.state.rank == "full" and planned.parent == formed_over
        if not natural:  # the forward does not compute the planned chain: record what it does
            exact_previous = ChunkState.patched(previous.ref.key, "full", formed_over)
            context = formed_over.extend(exact_previous)
            # The step was just built for this walk: changing it in place is safe.
            step.state = ChunkState.patched(step.ref.key, step.state.rank, context)
        step.in_run, step.forwards = True, 0
        return step

    def across_gap(self, step: Step, group: Sequence[Step]) -> Step:
        """A formation after placed chunks joins the forward of this op's earlier formations
        (``group``, consecutive or not) where the engine supports gaps and every member is served
        as that forward's output (its full KV): the forward then computes exactly the planned
        chain, each chunk seeing the placed chunks to its left and the members before it. A
        rank-m member is served as canonical + patch, not as the forward's output: the next
        formation after a gap starts a forward of its own.
        """
        if not self.inputs.gaps or step.kind != "form_patch" or step.off_window or step.in_run or not group:
            return step
        if not all(member.state.rank == "full" for member in group):
            return step
        step.in_run, step.forwards = True, 0
        return step

    def form_canonical(self, ref: ChunkRef, chunk: Chunk) -> Step:
        """The chunk's canonical: from the store, else one prefill behind the anchor."""
        stored = self.view.has_canonical(chunk.key)
        forwards = 0 if stored else 1  # the anchor, not computed yet, runs in the same forward
        if stored:
            detail = "canonical from the store (no forward)"
        elif chunk.has_vision:
            vision = chunk.vision_key is not None and self.view.has_vision(chunk.vision_key)
            detail = "prefill behind the anchor" + (" (vision output from the store)" if vision else "")
        else:
            detail = "prefill behind the anchor"
        return Step(
            "form_canonical",
            ref,
            self.canonical(ref),
            forwards=forwards,
            tokens=chunk.num_tokens * (not stored),
            detail=detail,
        )

    def canonical(self, ref: ChunkRef) -> ChunkState:
        return ChunkState.canonical(ref.key, self.root)

    def rank_of(self, chunk: Chunk) -> StateRank:
        rank = self.rank
        return effective_rank(rank, chunk.num_tokens, self.inputs.features) if rank != 0 else 0

    def stored_orbit(
        self, chunk_key: str, rank: StateRank, address: str, keyset: int = 0
    ) -> ChunkState | None:
        info = self.view.patch_info(chunk_key, address)
        if info is None:
            return None
        members = tuple(json.loads(info[1].get("members", "[]")))
        orbit = ChunkState.orbit(chunk_key, rank, self.root, address, members, keyset)
        if orbit.digest != info[0]:
            return None
        if rank == "full" and not self.view.has_full(chunk_key, orbit.stored_as):
            return None  # a full-rank orbit is its mean KV: gone, so is the orbit
        return orbit

    def _cost_of(
        self, s: ChunkState, chunk: Chunk, cost: Callable[[ChunkState], tuple[int, int] | None]
    ) -> tuple[int, int] | None:
        """Forwards and tokens to have state ``s`` of ``chunk`` from the store (rebuilding what is not)."""
        full = s.is_full
        if full and self.view.has_full(s.chunk_key, s.stored_as):
            return (0, 0)
        if full and s.kind == "orbit":
            return None
        if s.kind == "recomputed":  # its source placed behind its context, a share recomputed
            assert s.source is not None
            parts = [cost(a) for a in s.antecedents()]
            if any(part is None for part in parts):
                return None
            selected = selected_count(s.share, chunk.num_tokens)
            underneath = sum(p[1] for p in parts if p)
            probe = 0 if s.head else chunk.num_tokens  # the deviation probe that picks the tokens
            return 2 + sum(p[0] for p in parts if p), probe + selected + underneath
        if not can_form(chunk, self.view):
            return None
        canonical = (0, 0) if full or self.view.has_canonical(s.chunk_key) else (1, chunk.num_tokens)
        if s.kind == "canonical" or (
            not full and s.kind == "patched" and self.view.has_patch(s.chunk_key, s.digest)
        ):
            return canonical
        if s.kind == "orbit":
            return canonical if self.stored_orbit(s.chunk_key, s.rank, s.address, s.keyset) == s else None
        below = [cost(a) for a in s.context.states()]
        if any(b is None for b in below):
            return None
        forwards = canonical[0] + 1 + sum(b[0] for b in below if b is not None)
        tokens = canonical[1] + chunk.num_tokens + sum(b[1] for b in below if b is not None)
        return forwards, tokens

    def rebuild_cost(self, state: WindowRecord, context: Context) -> tuple[int, int] | None:
        """Forwards and tokens to rebuild every state of ``context`` from the store; ``None`` if one
        cannot be (its chunk is forgotten, an orbit changed, an image lost its pixels and KV)."""
        chunks = {entry.chunk.key: entry.chunk for entry in state.entries.values()}
        memo: dict[str, tuple[int, int] | None] = {}

        def cost(s: ChunkState) -> tuple[int, int] | None:
            if s.digest in memo:
                return memo[s.digest]
            memo[s.digest] = None  # a cycle cannot occur; this only guards re-entry
            chunk = chunks.get(s.chunk_key)
            memo[s.digest] = None if chunk is None else self._cost_of(s, chunk, cost)
            return memo[s.digest]

        total = [cost(s) for s in context.states()]
        if any(t is None for t in total):
            return None
        return sum(t[0] for t in total if t), sum(t[1] for t in total if t)
