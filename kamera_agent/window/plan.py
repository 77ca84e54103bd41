"""A planned window operation: the new order, evictions, admissions and one step per chunk.

Why a value: the planner computes it without touching the window, the store or the model (so
``window.plan(...)`` is a dry run by construction), the executor applies it as one
transaction, and `WindowPlan.public` turns the same object into the user-facing `Plan`, whose
predicted forwards are the executor's, step for step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.core.identity import ChunkState
from kamera_agent.results import Edit, EditKind, Plan
from kamera_agent.window.state import ChunkRef

__all__ = ["Step", "WindowPlan", "canonical_leads_run", "serves_canonical_first"]


@dataclass(slots=True)
class Step:
    """One executable edit for one chunk (built by the planner, read-only once in a plan).

    Attributes:
        kind: the edit (``form_canonical`` makes sure the canonical exists; the others set the chunk's KV).
        ref: the chunk.
        state: what the chunk's KV encodes after the step.
        antecedents: the refs its KV encodes after the step (the graph's in-edges); ``None``
            leaves its edges as they are (a chunk kept as it was).
        variant: for ``apply_patch``: where the stored patch is filed.
        off_window: for ``form_patch``: the context is not the chunk's left in the window (a
            recall's original context, placed behind the anchor for the forward).
        in_run: for ``form_patch``: prefilled in the forward of the chunk before it (consecutive
            formations over one left context share one forward).
        needs_canonical: its KV is built on the chunk's canonical, which the store does not hold:
            a ``form_canonical`` runs first.
        source: for ``rotate``: the chunk of the same content that held this slot before the op,
            whose KV this one takes (repeated content: what a prefix cache would reuse).
        forwards: forwards the step runs (rebuilding an original context included).
        tokens: tokens those forwards prefill.
        detail: why, in words (shown in plans).
    """

    kind: EditKind
    ref: ChunkRef
    state: ChunkState
    antecedents: tuple[ChunkRef, ...] | None = None
    variant: str = ""
    off_window: bool = False
    in_run: bool = False
    needs_canonical: bool = False
    source: ChunkRef | None = None
    forwards: int = 0
    tokens: int = 0
    detail: str = ""


@dataclass(frozen=True)
class WindowPlan:
    """An operation's new order, its evictions and admissions, and per-chunk steps in order.

    ``moved`` holds the chunks whose start changes (a ``rotate`` of any other chunk is no edit
    at all). ``probes`` non-empty means the eviction policy needs probe scores first: the
    executor runs those probes (for ``probe_query``), records the scores and plans again.
    """

    op: str
    order: tuple[ChunkRef, ...]
    evicted: tuple[ChunkRef, ...] = ()
    admitted: tuple[ChunkRef, ...] = ()
    steps: tuple[Step, ...] = ()
    chunks: Mapping[ChunkRef, Chunk] = field(default_factory=dict)
    moved: frozenset[ChunkRef] = frozenset()
    probes: tuple[ChunkRef, ...] = ()
    probe_query: str = ""
    probe_tokens: int = 0
    recalled: tuple[ChunkRef, ...] = ()
    """Of ``admitted``, the evicted chunks that come back (`Planner.arrange`)."""
    vouched_to: int | None = None
    """With a drift budget, the first chunk whose planned state the budget could not vouch for
    before the op ran (`PrefixBound.bounded` counted re-prefilling from it): the fix may start there
    instead of at the first chunk found over ε, where that prefills fewer tokens."""
    prefix_bound: int | None = None
    """With a drift budget, the tokens re-prefilling from the op's first changed slot costs (what
    a prefix cache pays, `PrefixBound.cheaper`): the most the op with every fix may prefill."""
    fix_bound: int = 0
    """With a drift budget, the most its fixes were counted to re-prefill after the plan (from
    ``vouched_to`` to ``trailing_from``, else to the end): what an op's fix share is a share of
    (`DriftBudget.record`)."""
    trailing_from: int | None = None
    """With a drift budget, the first of the chunks at the end the plan forms exactly over their
    left (new content, mostly) when a chunk left of them is approximated: the runner audits and
    fixes the chunks left of this slot first and forms these over what stands, so a fix never
    re-forms what the op has just formed (`PrefixBound.cheaper` counts the fixes so)."""
    tail: int = 0
    """Tokens at the start of the op's first in-window formation that the retained cache holds
    already, fed by the last decode at the same place (`kamera_agent.window.tail`): reused, not
    prefilled."""
    declined: bool = False
    """A re-prefill planned instead of approximations the drift budget expects to fail
    (`DriftBudget.worth_trying`): the runner counts it once the op has run."""

    def changed(self, **changes: Any) -> WindowPlan:
        """This plan with ``changes`` to its fields: what ``dataclasses.replace`` makes, without
        its walk over every field per call (an op's plan is remade two to four times)."""
        unknown = changes.keys() - _PLAN_FIELDS
        if unknown:
            raise TypeError(f"WindowPlan has no field {sorted(unknown)[0]!r}")
        twin = object.__new__(WindowPlan)
        twin.__dict__.update(self.__dict__, **changes)
        return twin

    def public(self) -> Plan:
        """The user-facing `Plan`: labelled edits with the forwards and tokens each will run."""
        edits = [
            Edit(
                "probe",
                ref.label,
                f"scored against {self.probe_query!r} (one decode)",
                1,
                self.probe_tokens,
                ref,
            )
            for ref in self.probes
        ]
        if self.probes:
            edits.append(Edit("evict", "the lowest-KL chunk", "chosen by the probes above"))
        edits += [
            Edit("evict", ref.label, "leaves the window; canonical kept", ref=ref) for ref in self.evicted
        ]
        edits += [
            Edit("recall", ref.label, "comes back from eviction", ref=ref)
            if ref in self.recalled
            else Edit("admit", ref.label, "enters the window", ref=ref)
            for ref in self.admitted
        ]
        for step in self.steps:
            if step.kind == "rotate" and step.ref not in self.moved:
                continue
            detail = step.detail + (" (in the forward of the chunk before it)" if step.in_run else "")
            edits.append(Edit(step.kind, step.ref.label, detail, step.forwards, step.tokens, step.ref))
        return Plan(self.op, tuple(edits))


_PLAN_FIELDS = frozenset(f.name for f in fields(WindowPlan))


def serves_canonical_first(steps: Sequence[Step], index: int, order: Sequence[ChunkRef]) -> bool:
    """``steps[index:index + 2]`` form the window's first chunk's canonical and serve the chunk
    as it (a revert, or a rotate of a chunk admitted there): the canonical is the chunk behind
    the anchor alone, so the forward that forms it is the window's own from the first slot."""
    if index + 1 >= len(steps) or not order:
        return False
    make, serve = steps[index], steps[index + 1]
    return (
        make.kind == "form_canonical"
        and serve.kind in ("revert", "rotate")
        and serve.source is None
        and serve.state.kind == "canonical"
        and serve.ref == make.ref
        and order[0] == make.ref
    )


def canonical_leads_run(steps: Sequence[Step], index: int, order: Sequence[ChunkRef]) -> bool:
    """`serves_canonical_first` at ``index``, then the second chunk formed over it: one forward
    from the first slot computes both (the executor runs them so where the store lacks the
    canonical; the planner counts them so)."""
    if index + 2 >= len(steps) or len(order) < 2 or not serves_canonical_first(steps, index, order):
        return False
    first = steps[index + 2]
    return first.kind == "form_patch" and not first.off_window and not first.in_run and order[1] == first.ref
