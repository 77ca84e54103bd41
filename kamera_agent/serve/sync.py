"""A new message list against a conversation window: the one edit that makes the window match it.

Why a diff by content key: every turn resends the whole history, changed where the agent
slid its screenshots, dropped a tool output or re-sent an earlier frame. A prefix cache misses
from the first changed token; kamera maps the change onto one `KameraWindow.arrange`:

    chunks no longer sent          → evicted (recallable)
    survivors in another order     → moved
    evicted chunks sent again      → recalled at their place, where that prefills no more than
                                     admitting the content anew
    new content                    → admitted where it stands (one forward for a new tail)
    the last message               → chunks of an open message (a user's or a tool's), closed
                                     by the question's framing: the next turn finds it

Chunks are matched by content key, with multiplicity (two identical messages are two chunks),
so the same screenshot re-sent as base64 is the same chunk. One op per request: every chunk is
settled once, and the request never prefills more than a cold server's prompt (the op is bounded
by a re-prefill from its first changed slot). Its plan and cost are in ``window.stats``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from difflib import SequenceMatcher

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.errors import KameraError
from kamera_agent.results import OpCost, Plan
from kamera_agent.serve.messages import Prepared
from kamera_agent.serve.usage import Provenance
from kamera_agent.window import KameraWindow
from kamera_agent.window.state import ChunkRef

__all__ = ["SyncReport", "sync_window"]

Target = list[ChunkRef | Chunk]
"""What the window should hold, in order: refs it knows, or new content."""


@dataclass
class SyncReport:
    """What one request did to its window before the answer.

    Attributes:
        ops: ``(op, labels, cost)`` in the order they ran (one ``arrange``, or none when the
            window already held the request's chunks).
        plans: each op's executed edits.
        prompt_tokens: the request's whole prompt: anchor, every chunk, the query.
        provenance: what the window held before and which chunks the ops' forwards made.
    """

    ops: list[tuple[str, list[str], OpCost]] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    prompt_tokens: int = 0
    provenance: Provenance | None = None

    @property
    def cost(self) -> OpCost:
        return sum((cost for _, _, cost in self.ops), OpCost())


def sync_window(window: KameraWindow, prepared: Prepared, *, prefix_only: bool = False) -> SyncReport:
    """Edit ``window`` to hold what a request prepared (every message as chunks), in one op;
    returns what it did. ``prefix_only``: as a prefix cache would, keep the unchanged leading
    chunks and admit everything from the first change anew."""
    report = SyncReport(provenance=Provenance.of(window))
    desired = list(prepared.chunks)
    target = _prefix_target(window, desired) if prefix_only else _target(window, desired)
    if target != window.refs:
        window.arrange(target)
        plan = window.last_plan
        assert plan is not None
        changed = [edit.label for edit in plan.edits if edit.kind in ("evict", "recall", "admit")]
        report.ops.append(("arrange", changed, window.stats.last))
        report.plans.append(plan)
        if report.provenance is not None:
            report.provenance.saw(plan)
    report.prompt_tokens = window.encoder.anchor().num_tokens + sum(
        window.chunk(ref).num_tokens for ref in window.refs
    )
    return report


def _target(window: KameraWindow, desired: list[Chunk]) -> Target:
    """The request's chunks as the window should hold them: the longest runs of in-window chunks
    that keep their order stay; an in-window copy wanted elsewhere before the last of those moves
    there; an evicted copy comes back where recalling it prefills no more than new content
    (a dry run of each choice); everything else is new content."""
    current = window.refs
    keys = [window.chunk(ref).key for ref in current]
    in_order: dict[int, ChunkRef] = {}
    matcher = SequenceMatcher(None, keys, [chunk.key for chunk in desired], autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            in_order[block.b + k] = current[block.a + k]
    last_in_order = max(in_order, default=-1)
    in_place = set(in_order.values())
    spare: dict[str, deque[ChunkRef]] = defaultdict(deque)
    for ref, key in zip(current, keys, strict=True):
        if ref not in in_place:
            spare[key].append(ref)
    target: Target = []
    for index, chunk in enumerate(desired):
        if index in in_order:
            target.append(in_order[index])
        elif index < last_in_order and spare[chunk.key]:
            target.append(spare[chunk.key].popleft())
        else:
            target.append(chunk)
    staying = {item for item in target if isinstance(item, ChunkRef)}
    evicted: dict[str, deque[ChunkRef]] = defaultdict(deque)
    for ref in [*window.evicted, *(r for r in current if r not in staying)]:
        evicted[window.chunk(ref).key].append(ref)
    cost: float | None = None  # planned only where a recall is weighed: most requests weigh none
    for index, item in enumerate(target):
        if isinstance(item, Chunk) and evicted[item.key]:
            if cost is None:
                cost = _tokens(window, target)
            trial = [*target[:index], evicted[item.key][-1], *target[index + 1 :]]  # the most recent copy
            trial_cost = _tokens(window, trial)
            if trial_cost <= cost:
                target, cost = trial, trial_cost
                evicted[item.key].pop()
    return target


def _prefix_target(window: KameraWindow, desired: list[Chunk]) -> Target:
    """A prefix cache's target: the window's chunks up to the first one the request changes,
    then the request's own chunks, new."""
    current = window.refs
    same = 0
    while same < min(len(current), len(desired)) and window.chunk(current[same]).key == desired[same].key:
        same += 1
    return [*current[:same], *desired[same:]]


def _tokens(window: KameraWindow, target: Target) -> float:
    """Tokens arranging ``target`` prefills (a dry run); infinite where it cannot run (a lost chunk)."""
    try:
        return window.plan.arrange(target).tokens_prefilled
    except KameraError:
        return float("inf")
