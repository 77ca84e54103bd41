"""A new message list against a conversation window: the edit that makes the window match it.

Why a diff by content key: every turn resends the whole history, changed where the agent
slid its screenshots, dropped a tool output or re-sent an earlier frame. A prefix cache misses
from the first changed token; kamera maps the change onto window ops:

    chunks no longer sent          → evict (recallable)
    survivors in another order     → reorder
    evicted chunks sent again      → recall, at their place
    new content                    → extend at the end (one forward), or push then reorder
    the last user message's text   → the query (its images: chunks of an open message)

Chunks are matched by content key, with multiplicity (two identical messages are two chunks),
so the same screenshot re-sent as base64 is the same chunk. Every op is a window op: its plan
and its cost are in ``window.stats``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.errors import ChunkLostError, KameraError
from kamera_agent.results import OpCost
from kamera_agent.serve.messages import Prepared
from kamera_agent.serve.usage import Provenance
from kamera_agent.window import KameraWindow
from kamera_agent.window.state import ChunkRef

__all__ = ["SyncReport", "sync_window"]


@dataclass
class SyncReport:
    """What one request did to its window before the answer.

    Attributes:
        ops: ``(op, labels, cost)`` in the order they ran.
        query: the question (the last user message's trailing text; ``""`` if it has none).
        in_message: the query ends a message whose images are chunks.
        prompt_tokens: the request's whole prompt: anchor, every chunk, the query.
        provenance: what the window held before and which chunks the ops' forwards made.
    """

    ops: list[tuple[str, list[str], OpCost]] = field(default_factory=list)
    query: str = ""
    in_message: bool = False
    prompt_tokens: int = 0
    provenance: Provenance | None = None

    @property
    def cost(self) -> OpCost:
        return sum((cost for _, _, cost in self.ops), OpCost())


def sync_window(window: KameraWindow, prepared: Prepared) -> SyncReport:
    """Edit ``window`` to hold what a request prepared (every chunk but the question); returns
    what it did."""
    desired = list(prepared.chunks)
    report = SyncReport(
        query=prepared.query, in_message=prepared.in_message, provenance=Provenance.of(window)
    )
    current = window.refs
    keys = [window.chunk(ref).key for ref in current]
    # Chunks that keep their order (the longest matching runs) stay put. A chunk the request
    # has elsewhere before the last of those moves there (one reorder re-settles what follows
    # it, as any edit there must); a copy wanted only after them leaves, and the tail is
    # admitted after the rest (recalled, or new: one forward).
    kept: dict[int, ChunkRef] = {}
    matcher = SequenceMatcher(None, keys, [chunk.key for chunk in desired], autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            kept[block.b + k] = current[block.a + k]
    last_kept = max(kept, default=-1)
    in_place = set(kept.values())
    spare: dict[str, deque[ChunkRef]] = defaultdict(deque)
    for ref, key in zip(current, keys, strict=True):
        if ref not in in_place:
            spare[key].append(ref)
    plan: list[tuple[str, Any]] = []  # ("keep", ref) | ("recall", ref) | ("new", chunk)
    for index, chunk in enumerate(desired):
        if index in kept:
            plan.append(("keep", kept[index]))
        elif index < last_kept and spare[chunk.key]:
            plan.append(("keep", spare[chunk.key].popleft()))  # moved by the reorder below
        else:
            plan.append(("new", chunk))
    staying = {ref for kind, ref in plan if kind == "keep"}
    evicted: dict[str, deque[ChunkRef]] = defaultdict(deque)
    for ref in [*window.evicted, *(r for r in current if r not in staying)]:
        evicted[window.chunk(ref).key].append(ref)
    candidates: dict[int, ChunkRef] = {}
    for index, (kind, chunk) in enumerate(plan):
        if kind == "new" and evicted[chunk.key]:
            candidates[index] = evicted[chunk.key].pop()  # the most recent copy

    gone = [ref for ref in current if ref not in staying]
    if gone:
        _run(report, window, "evict", gone, lambda: window.evict(*gone))
    survivors = [ref for kind, ref in plan if kind == "keep"]
    if survivors != window.refs:
        _run(report, window, "reorder", survivors, lambda: window.reorder(survivors))
    for index, ref in candidates.items():
        if index < last_kept or _recall_is_cheaper(window, ref, plan[index][1]):
            plan[index] = ("recall", ref)

    final: list[ChunkRef] = []  # the refs in the order the request wants them
    placed = 0  # refs of ``final`` at their place: the window's first ``placed``
    for index, (kind, item) in enumerate(plan):
        if kind == "keep":
            final.append(item)
            placed += 1
        elif kind == "recall":
            try:
                _run(report, window, "recall", [item], lambda r=item, at=placed: window.recall(r, at=at))
            except ChunkLostError:  # its pixels and stored KV are gone: admit the content anew
                final += _run_extend(report, window, [desired[index]])
                continue
            final.append(item)
            placed += 1
        elif all(k == "new" for k, _ in plan[index:]) and placed == len(window.refs):
            final += _run_extend(report, window, [c for _, c in plan[index:]])  # the usual turn: one forward
            break
        else:  # new content mid-history: admitted at the end, moved by the reorder below
            final += _run_extend(report, window, [item])
    if final != window.refs:
        _run(report, window, "reorder", final, lambda: window.reorder(final))
    report.prompt_tokens = window.encoder.anchor().num_tokens + sum(
        window.chunk(ref).num_tokens for ref in window.refs
    )
    return report


def _recall_is_cheaper(window: KameraWindow, ref: ChunkRef, chunk: Chunk) -> bool:
    """Whether recalling ``ref`` at the end prefills fewer tokens than admitting its content anew.

    A recall at the end is free when nothing before it absorbed it; when survivors did (they
    keep what they took from an evicted chunk), the window must re-form them, since a chunk's
    KV cannot encode one to its right: then a new copy, in the tail's one forward, is cheaper.
    """
    try:
        planned = window.plan.recall(ref, at=len(window.refs))
    except KameraError:
        return False
    return planned.tokens_prefilled <= chunk.num_tokens


def _run(report: SyncReport, window: KameraWindow, op: str, refs: list[ChunkRef], do: Any) -> None:
    do()
    report.ops.append((op, [ref.label or str(ref) for ref in refs], window.stats.last))
    if report.provenance is not None:
        report.provenance.saw(window.last_plan)


def _run_extend(report: SyncReport, window: KameraWindow, chunks: list[Chunk]) -> list[ChunkRef]:
    refs = window.extend(chunks)
    report.ops.append(("extend", [chunk.label or chunk.key[:12] for chunk in chunks], window.stats.last))
    if report.provenance is not None:
        report.provenance.saw(window.last_plan)
    return refs
