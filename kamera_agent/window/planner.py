"""Planning window operations: which cache edit each chunk needs, read off the antecedent graph.

Why plan first: every operation (push, reorder, slide, evict, recall) reduces to the same
question per in-window chunk, asked left to right over the *new* order: does its KV still
encode exactly the chunks now to its left?

1. yes → **rotate** only (relocation is exact, no forward);
2. same antecedent *set*, other order, orbit patches on, an orbit patch stored → **apply** it;
3. a patch for exactly the new ordered antecedent stored → **apply** it (no forward);
4. its left context is what it was before this op (e.g. a reorder that moved only chunks to
   its right) and it encodes nothing now to its right → **rotate**: no reason to touch it;
5. otherwise the op's policy decides: **form** a patch (one conditioned forward), **keep**
   the old one (only while it encodes nothing now to its right: the graph stays causal and
   acyclic), **revert** to the canonical, or **defer** (lazy).

The plan is computed without touching the window, so ``window.plan(...)`` is a true dry run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kamera_agent.policies import PatchAction
from kamera_agent.results import Edit, EditKind, Plan
from kamera_agent.window.state import ChunkRef, WindowState, ordered_signature, set_signature

__all__ = ["PlanContext", "Step", "WindowPlan", "decide", "formable_run"]


@dataclass(frozen=True)
class Step:
    """One executable edit for one chunk.

    Attributes:
        kind: the edit.
        ref: the chunk.
        antecedents: for ``form_patch``/``apply_patch``: the ordered context the patch encodes.
        signature: for ``apply_patch``: the stored patch's antecedent signature.
        detail: why, in words (shown in plans).
    """

    kind: EditKind
    ref: ChunkRef
    antecedents: tuple[ChunkRef, ...] = ()
    signature: str = ""
    detail: str = ""


@dataclass(frozen=True)
class WindowPlan:
    """An operation's new order, its evictions and admissions, and per-chunk steps in order."""

    op: str
    order: tuple[ChunkRef, ...]
    evicted: tuple[ChunkRef, ...] = ()
    admitted: tuple[ChunkRef, ...] = ()
    steps: tuple[Step, ...] = ()
    chunks: dict[ChunkRef, Any] = field(default_factory=dict)

    def public(self, encodes: dict[ChunkRef, int], tokens: dict[ChunkRef, int]) -> Plan:
        """The user-facing `Plan`: labelled edits with their predicted forwards and tokens.

        ``encodes`` says which chunks' canonicals must be prefilled (0: stored). Consecutive
        patch formations share one forward (`formable_run`), so only the first of a run counts one.
        """
        edits = [Edit("evict", ref.label, "leaves the window; canonical kept") for ref in self.evicted]
        edits += [Edit("admit", ref.label, "enters the window") for ref in self.admitted]
        shared: set[ChunkRef] = set()
        for index, step in enumerate(self.steps):
            if step.kind == "form_patch" and step.ref not in shared:
                shared.update(formable_run(self.steps, index, self.order)[1:])
        for step in self.steps:
            n = tokens.get(step.ref, 0)
            if step.kind == "encode":
                runs = encodes.get(step.ref, 0)
                edits.append(Edit("encode", step.ref.label, step.detail, runs, n * runs))
            elif step.kind == "form_patch":
                detail = step.detail + (
                    " (in the forward of the chunk before it)" if step.ref in shared else ""
                )
                edits.append(Edit("form_patch", step.ref.label, detail, int(step.ref not in shared), n))
            else:
                edits.append(Edit(step.kind, step.ref.label, step.detail))
        return Plan(self.op, tuple(edits))


@dataclass(frozen=True)
class PlanContext:
    """What planning reads besides the window state: the rank, policies and the patch store."""

    anchor_key: str
    rank: int | Literal["full"]
    orbit: bool
    has_patch: Any  # Callable[[str, str], bool]: (chunk key, signature) -> stored?

    def ordered(self, refs: Sequence[ChunkRef]) -> str:
        return ordered_signature(self.anchor_key, (ref.key for ref in refs), self.rank)

    def unordered(self, refs: Sequence[ChunkRef]) -> str:
        return set_signature(self.anchor_key, (ref.key for ref in refs), self.rank)


def decide(
    state: WindowState,
    ctx: PlanContext,
    ref: ChunkRef,
    order: Sequence[ChunkRef],
    fallback: PatchAction,
) -> Step:
    """The edit ``ref`` needs at its place in ``order`` (see the module docstring)."""
    index = order.index(ref)
    left = tuple(order[:index])
    entry = state.entries[ref]
    current = state.encodes(ref)
    if ctx.rank == 0:
        if entry.patch is not None:
            return Step("revert", ref, detail="blind reuse: canonical only")
        return Step("rotate", ref, detail="blind reuse: relocation only")
    if entry.pending:
        return Step("defer", ref, detail="patch still due (lazy)")
    if current == left and (entry.patch is not None or not left):
        return Step("rotate", ref, left, detail="antecedents unchanged: relocation only")
    if not left:
        return Step("revert", ref, detail="first in the window: the canonical is exact")
    if ctx.orbit and set(current) == set(left) and ctx.has_patch(ref.key, ctx.unordered(left)):
        return Step("apply_patch", ref, left, ctx.unordered(left), "same antecedent set: orbit patch")
    if ctx.has_patch(ref.key, ctx.ordered(left)):
        return Step("apply_patch", ref, left, ctx.ordered(left), "stored patch for these antecedents")
    before = state.order
    causal = not set(current) & set(order[index:])  # it encodes nothing now at or right of it
    if ref in before and tuple(before[: before.index(ref)]) == left and causal:
        return Step("rotate", ref, current, detail="this op left its left context as it was")
    return _fallback(state, ref, order, left, current, fallback)


def _fallback(
    state: WindowState,
    ref: ChunkRef,
    order: Sequence[ChunkRef],
    left: tuple[ChunkRef, ...],
    current: tuple[ChunkRef, ...],
    action: PatchAction,
) -> Step:
    if action == "keep":
        to_the_right = set(order[order.index(ref) :])
        if not set(current) & to_the_right:
            return Step("rotate", ref, current, detail="keeps its patch (policy: keep)")
        return Step("form_patch", ref, left, detail="its patch encodes a chunk now to its right")
    if action == "revert":
        return Step("revert", ref, detail="no stored patch fits (policy: revert)")
    if action == "defer":
        return Step("defer", ref, detail="patch formed before the next read (lazy)")
    return Step("form_patch", ref, left, detail="conditioned forward over its new left context")


def formable_run(steps: Sequence[Step], index: int, order: Sequence[ChunkRef]) -> list[ChunkRef]:
    """The refs of the ``form_patch`` steps from ``index`` on that follow each other in ``order``
    and are each conditioned on everything to their left: one forward serves them all."""
    run: list[ChunkRef] = []
    for step in steps[index:]:
        position = order.index(step.ref) if step.ref in order else -1
        follows = not run or (position > 0 and order[position - 1] == run[-1])
        if step.kind != "form_patch" or not follows or tuple(order[:position]) != step.antecedents:
            break
        run.append(step.ref)
    return run
