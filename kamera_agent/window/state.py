"""A window's state: the deque of chunks, what each chunk's KV encodes, and nothing derivable.

Why this shape: positions are derived from the order (each chunk starts where the previous one
advanced to), so they are never stored. What each chunk's KV encodes is its `ChunkState` (the
chained digest of its content, patch and antecedent states); the antecedent graph records the
same as edges A→B ("B's KV encodes A"), each edge carrying A's place in B's antecedents and the
state of A that B encodes. Everything mutable lives in one `WindowRecord`, so a transaction (a
failed op restores the copy) and ``fork`` (a branch with its own ref space) are one mechanism.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.core import Patch
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.results import Answer
from kamera_agent.window.costs import StatsBook

__all__ = [
    "Assembled",
    "ChunkRef",
    "Entry",
    "LastAnswer",
    "OriginalContext",
    "Scores",
    "WindowRecord",
]


@dataclass(frozen=True, order=True)
class ChunkRef:
    """A handle on one admitted chunk, valid in the window (branch) that minted it.

    A fork shares the refs minted before it and mints its own after it: two branches never hand
    out equal refs, and a ref from another window or branch is refused with `UnknownChunkError`.

    Attributes:
        id: the chunk's number in its window family.
        lineage: the branch that minted it.
        key: the chunk's content key.
        label: the caller's label (defaults to the kind and number, e.g. ``frame-3``).
    """

    id: int
    lineage: str
    key: str = field(compare=False)
    label: str = field(compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.id, self.lineage)))  # refs key every dict

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"ChunkRef({self.label!r})"


@dataclass(frozen=True)
class OriginalContext:
    """A chunk's first settled KV: its antecedents then and the state it had (recall's context)."""

    refs: tuple[ChunkRef, ...]
    state: ChunkState


@dataclass
class Entry:
    """Everything a window records about one chunk besides its graph edges.

    Attributes:
        chunk: the model-ready chunk (an evicted image drops its pixels once they are not needed).
        state: what its KV encodes (an evicted chunk holds its last state).
        in_window: whether it is in the window now (else evicted, recallable).
        patch: the patch its KV carries while in the window (``None``: its canonical or full KV).
        full: its full KV while in the window, for a full-rank state (the same tensors the store
            holds, kept alive here: rebuilding one the store dropped would need every antecedent's
            chunk, and a full-rank orbit's mean cannot be rebuilt at all).
        pending: its patch is due (lazy timing) and is formed before the next read.
        original: its first settled state and antecedents: the fixed earlier context recall uses.
        last_used: op counter of its last push, recall or reorder.
        evicted_at: op counter of its eviction (the oldest evicted are forgotten first).
        canonical_formed: its canonical has been computed at least once (a later miss is a re-form).
        set_from: the antecedents its in-edges were last set from (`WindowRecord.set_antecedents`),
            so an op asking for the same ones again knows its edges without reading the graph.
        set_states: the state of each of ``set_from`` that its KV encodes, one digest each, or
            the context that says them (read when asked: most are never read).
    """

    chunk: Chunk
    state: ChunkState
    in_window: bool = True
    patch: Patch | None = None
    full: ChunkKV | None = None
    pending: bool = False
    original: OriginalContext | None = None
    last_used: int = 0
    evicted_at: int = 0
    canonical_formed: bool = False
    set_from: tuple[ChunkRef, ...] | None = None
    set_states: tuple[str, ...] | Context = ()

    def copy(self) -> Entry:
        """A shallow copy (`WindowRecord.copy` takes one of every entry each op: `copy.copy`'s
        generic protocol cost more than the rest of a snapshot)."""
        twin = Entry.__new__(Entry)
        twin.__dict__.update(self.__dict__)
        return twin


@dataclass(frozen=True)
class LastAnswer:
    """The last greedy answer and the op counter it was computed at (stale once it moves)."""

    query: str
    tick: int
    answer: Answer


@dataclass(frozen=True)
class Scores:
    """Probe KLs of the window's chunks for one query at one op counter (probe-driven eviction)."""

    query: str
    tick: int
    kl: dict[ChunkRef, float]


@dataclass(frozen=True)
class Assembled:
    """The engine cache the last answer was decoded over (or the last in-window formation ran
    over), and what each of its stretches held.

    A stretch is ``("anchor",)`` or ``(ref, start, state digest)`` with its slot count: the next
    answer reuses the longest prefix of stretches that is unchanged (crop) and appends the rest.
    The cache object is the engine's, mutated by decodes and formations (which only append); it
    is cropped before every reuse, so whatever was appended beyond its stretches is read only as
    ``tail`` says.

    ``tail``: the token ids a decode fed after the stretches (the query, then the answer tokens
    fed back), or ``None``. A conversation's next turn sends that question's closing and the
    answer as new chunks right there: their slots are the model's own KV of those tokens, which
    a prefix cache reuses too (`kamera_agent.window.tail`).
    """

    cache: Any
    stretches: tuple[tuple[tuple[Any, ...], int], ...]
    tail: torch.Tensor | None = None


def _lineage() -> str:
    return secrets.token_hex(6)


def _copied(graph: nx.DiGraph) -> nx.DiGraph:
    """A graph that shares ``graph``'s adjacency until written: its outer dicts are copies, the
    per-node dicts inside them are the original's until `WindowRecord` copies one to change it.

    Why: every op that writes the graph snapshots it first, and copying every node's dicts was
    O(nodes + edges), nodes that left the window included (up to ``max_evicted`` of them, each
    with its edges): ops grew slower as an agent's session grew. An op writes the dicts of the
    few nodes it re-forms. networkx's dict-of-dicts is documented; assigning ``_adj`` and
    ``_pred`` is what its own descriptors support (they reset the cached views). Node and edge
    attribute dicts are shared outright: neither carries anything here (what an edge records
    lives on its target's `Entry`; `KameraWindow.graph` decorates a copy)."""
    copied = nx.DiGraph()
    copied.graph.update(graph.graph)
    copied._node = dict(graph._node)
    copied._adj = dict(graph._adj)
    copied._pred = dict(graph._pred)
    return copied


@dataclass
class WindowRecord:
    """The mutable part of a window; ``copy()`` is a cheap, independent snapshot.

    A record, not a "state": a chunk's **state** is what its KV encodes (`ChunkState`, each
    entry's ``state``); this is the window's bookkeeping around its chunks.
    """

    lineage: str = field(default_factory=_lineage)
    order: list[ChunkRef] = field(default_factory=list)
    entries: dict[ChunkRef, Entry] = field(default_factory=dict)
    _graph: nx.DiGraph = field(default_factory=nx.DiGraph, repr=False)
    next_id: int = 0
    tick: int = 0
    last_answer: LastAnswer | None = None
    scores: Scores | None = None
    assembled: Assembled | None = None
    book: StatsBook = field(default_factory=StatsBook)
    _owns_graph: bool = field(default=True, repr=False)
    _own_succ: set[ChunkRef] = field(default_factory=set, repr=False)
    _own_pred: set[ChunkRef] = field(default_factory=set, repr=False)
    """Nodes whose out- and in-edge dicts this state's graph holds as its own (copied from the
    graph it was snapshotted from, or made here): only those are changed in place."""

    @property
    def graph(self) -> nx.DiGraph:
        """The antecedent graph: read it here, change it through `add`, `remove`, `set_antecedents`."""
        return self._graph

    def _writable_graph(self) -> nx.DiGraph:
        """The graph, copied first if a snapshot shares it (copy on write: every op snapshots the
        state and most ops never touch the graph); `_copied` copies its outer dicts, a node's
        edge dicts are copied when this state first changes them (`_succ_of`, `_pred_of`)."""
        if not self._owns_graph:
            self._graph, self._owns_graph = _copied(self._graph), True
            self._own_succ, self._own_pred = set(), set()
        return self._graph

    def _succ_of(self, graph: nx.DiGraph, node: ChunkRef) -> dict[ChunkRef, Any]:
        """``node``'s out-edge dict in ``graph`` (the writable graph), made this state's own first."""
        if node not in self._own_succ:
            graph._adj[node] = dict(graph._adj[node])
            self._own_succ.add(node)
        return graph._adj[node]  # type: ignore[no-any-return]

    def _pred_of(self, graph: nx.DiGraph, node: ChunkRef) -> dict[ChunkRef, Any]:
        """``node``'s in-edge dict in ``graph`` (the writable graph), made this state's own first."""
        if node not in self._own_pred:
            graph._pred[node] = dict(graph._pred[node])
            self._own_pred.add(node)
        return graph._pred[node]  # type: ignore[no-any-return]

    def copy(self) -> WindowRecord:
        """A snapshot: same lineage, independent entries, graph (shared until either writes),
        memo and stats."""
        self._owns_graph = False
        return WindowRecord(
            lineage=self.lineage,
            order=list(self.order),
            entries={ref: entry.copy() for ref, entry in self.entries.items()},
            _graph=self._graph,
            _owns_graph=False,
            next_id=self.next_id,
            tick=self.tick,
            last_answer=self.last_answer,
            scores=self.scores,
            assembled=self.assembled,
            book=self.book.copy(),
        )

    def fork(self) -> WindowRecord:
        """A branch: the same chunks and costs so far, its own lineage for the refs it mints."""
        branch = self.copy()
        branch.lineage = _lineage()
        branch.assembled = None  # an engine cache is mutable: each branch assembles its own
        return branch

    def mint(self, chunk: Chunk, label: str | None, offset: int = 0) -> ChunkRef:
        """The ref the next admitted chunk gets, or the ``offset``-th after it when one op admits
        several (nothing is recorded until it is added)."""
        number = self.next_id + offset
        return ChunkRef(number, self.lineage, chunk.key, label or f"{chunk.kind}-{number}")

    def add(self, ref: ChunkRef, entry: Entry) -> None:
        self.entries[ref] = entry
        graph = self._writable_graph()
        if ref not in graph._node:
            graph.add_node(ref)  # its edge dicts are new: this state's own
            self._own_succ.add(ref)
            self._own_pred.add(ref)
        self.next_id = max(self.next_id, ref.id + 1)

    def remove(self, ref: ChunkRef) -> None:
        """Forget a chunk for good: its entry, its node and every edge from or to it."""
        del self.entries[ref]
        graph = self._writable_graph()
        for target in graph._adj[ref]:
            del self._pred_of(graph, target)[ref]
        for source in graph._pred[ref]:
            del self._succ_of(graph, source)[ref]
        del graph._adj[ref], graph._pred[ref], graph._node[ref]
        self._own_succ.discard(ref)
        self._own_pred.discard(ref)

    def recorded(self, ref: ChunkRef) -> tuple[tuple[ChunkRef, int, str], ...]:
        """What ``ref``'s in-edges record, left to right: each antecedent still known, its index
        among those its edges were set from, and the digest of its state that ``ref`` encodes."""
        entry = self.entries[ref]
        sources = entry.set_from or ()
        states = entry.set_states
        digests = [state.digest for state in states.states()] if isinstance(states, Context) else states
        known = self._graph._pred[ref]
        return tuple((source, i, digests[i]) for i, source in enumerate(sources) if source in known)

    def antecedents_of(self, ref: ChunkRef) -> tuple[ChunkRef, ...]:
        """The antecedents ``ref``'s current KV encodes (those still known), in their order."""
        known = self._graph._pred[ref]
        return tuple(source for source in self.entries[ref].set_from or () if source in known)

    def set_antecedents(
        self, ref: ChunkRef, antecedents: Sequence[ChunkRef], states: Sequence[str] | None = None
    ) -> None:
        """Make ``ref``'s in-edges exactly ``antecedents``, each recording the state ``ref``
        encodes (``states``: those digests, one per antecedent, where ``ref``'s context does not
        say them).

        What an edge records (its index, its state) lives on ``ref``'s entry, not on the edge:
        a slide moves every chunk one antecedent down, and rewriting each edge's attributes made
        that O(chunks²) dict writes per op. Only edges that leave or arrive are removed or
        added."""
        entries = self.entries
        entry = entries[ref]
        antecedents = tuple(antecedents)
        recorded: tuple[str, ...] | Context = ()
        if states is not None:
            recorded = tuple(states)
        elif antecedents:
            context = entry.state.context
            if context.length == len(antecedents):
                recorded = context  # read as digests only when asked (`recorded`)
            else:  # an orbit encodes a set: its members' states as they are
                recorded = tuple(entries[s].state.digest if s in entries else "" for s in antecedents)
        before = entry.set_from or ()
        entry.set_from, entry.set_states = antecedents, recorded
        current = self._graph._pred[ref]  # the known ones of ``before``
        cut = len(before) - len(antecedents)
        arriving: list[ChunkRef] = []
        if cut >= 0 and before[cut:] == antecedents:  # the same, the first ``cut`` gone (a slide)
            leaving = [source for source in before[:cut] if source in current]
        else:
            wanted = {source for source in antecedents if source in entries}
            leaving = [source for source in current if source not in wanted]
            if len(wanted) > len(current) - len(leaving):
                arriving = [source for source in antecedents if source in wanted and source not in current]
        if not leaving and not arriving:
            return
        graph = self._writable_graph()
        current = self._pred_of(graph, ref)
        for source in leaving:
            del self._succ_of(graph, source)[ref], current[source]
        for source in arriving:  # in order: the graph's order is the same run to run
            self._succ_of(graph, source)[ref] = current[source] = {}

    def dependents(self, ref: ChunkRef) -> list[ChunkRef]:
        """In-window chunks whose KV encodes ``ref``, left to right."""
        successors = set(self.graph.successors(ref))
        return [other for other in self.order if other in successors]
