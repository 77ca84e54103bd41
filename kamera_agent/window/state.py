"""A window's state: the deque of chunks, what each chunk's KV encodes, and nothing derivable.

Why this shape: positions are derived from the order (each chunk starts where the previous one
advanced to), so they are never stored; what each chunk's KV encodes lives only in the
antecedent graph (edge A→B: B's current KV encodes A, with the edge's ``index`` giving A's
place in B's antecedent sequence). The state copies cheaply, which gives ``fork`` (a branch)
and transactions (a failed op restores the copy) the same mechanism.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.operator.patch import Patch

__all__ = ["ChunkRef", "Entry", "WindowState", "ordered_signature", "set_signature"]

_lineages = itertools.count()


@dataclass(frozen=True, order=True)
class ChunkRef:
    """A handle on one admitted chunk. Forks of a window share their refs.

    Attributes:
        id: the chunk's number in its window family.
        key: the chunk's content key.
        label: the caller's label (defaults to the kind and number, e.g. ``frame-3``).
        lineage: the window family it belongs to.
    """

    id: int
    key: str = field(compare=False)
    label: str = field(compare=False)
    lineage: int

    def __repr__(self) -> str:
        return f"ChunkRef({self.label!r})"


@dataclass
class Entry:
    """Everything a window keeps about one chunk besides its graph edges.

    Attributes:
        chunk: the model-ready chunk.
        in_window: whether it is in the window now (else evicted, recallable).
        patch: the patch its current KV carries (``None``: the canonical alone).
        pending: its patch is due (lazy timing) and is formed before the next read.
        home: its antecedents when first admitted: the fixed earlier context recall uses.
        last_used: op counter of its last push, recall or reorder.
        encoded: its canonical has been computed at least once (a later miss is a re-encode).
    """

    chunk: Chunk
    in_window: bool = True
    patch: Patch | None = None
    pending: bool = False
    home: tuple[ChunkRef, ...] = ()
    last_used: int = 0
    encoded: bool = False


@dataclass
class WindowState:
    """The mutable part of a window; ``copy()`` is a cheap, independent snapshot."""

    lineage: int = field(default_factory=lambda: next(_lineages))
    order: list[ChunkRef] = field(default_factory=list)
    entries: dict[ChunkRef, Entry] = field(default_factory=dict)
    graph: nx.DiGraph = field(default_factory=nx.DiGraph)
    next_id: int = 0
    tick: int = 0
    last_answer: tuple[str, int, Any] | None = None  # (query, tick, Answer) of the last greedy ask

    def copy(self) -> WindowState:
        return WindowState(
            lineage=self.lineage,
            order=list(self.order),
            entries={ref: copy.copy(entry) for ref, entry in self.entries.items()},
            graph=self.graph.copy(),
            next_id=self.next_id,
            tick=self.tick,
            last_answer=self.last_answer,
        )

    def new_ref(self, chunk: Chunk, label: str | None) -> ChunkRef:
        ref = ChunkRef(self.next_id, chunk.key, label or f"{chunk.kind}-{self.next_id}", self.lineage)
        self.next_id += 1
        return ref

    def encodes(self, ref: ChunkRef) -> tuple[ChunkRef, ...]:
        """The antecedents ``ref``'s current KV encodes, in their order."""
        edges = self.graph.in_edges(ref, data="index")
        return tuple(source for source, _, _ in sorted(edges, key=lambda edge: edge[2]))

    def set_encodes(self, ref: ChunkRef, antecedents: Sequence[ChunkRef]) -> None:
        """Make ``ref``'s in-edges exactly ``antecedents`` (the graph is the source of truth)."""
        self.graph.remove_edges_from(list(self.graph.in_edges(ref)))
        self.graph.add_edges_from((source, ref, {"index": i}) for i, source in enumerate(antecedents))

    def add(self, ref: ChunkRef, entry: Entry) -> None:
        self.entries[ref] = entry
        self.graph.add_node(ref)

    def in_window(self) -> list[ChunkRef]:
        return list(self.order)

    def dependents(self, ref: ChunkRef) -> list[ChunkRef]:
        """In-window chunks whose KV encodes ``ref``, left to right."""
        successors = set(self.graph.successors(ref))
        return [other for other in self.order if other in successors]


def ordered_signature(anchor_key: str, keys: Iterable[str], rank: object) -> str:
    """Signature of an ordered antecedent: the patch it yields depends on order and rank."""
    return "ordered:" + _digest(anchor_key, *keys) + f"@{rank}"


def set_signature(anchor_key: str, keys: Iterable[str], rank: object) -> str:
    """Signature of an antecedent *set*: the orbit patch that serves all its orderings."""
    return "set:" + _digest(anchor_key, *sorted(keys)) + f"@{rank}"


def _digest(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\x1f")
    return digest.hexdigest()[:32]
