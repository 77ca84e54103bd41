"""`WindowRecord` snapshots: a copy shares the antecedent graph until either side writes it, and
what one side writes (edges added, removed, re-stated) never shows in the other."""

from __future__ import annotations

import torch

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.window.state import Entry, WindowRecord

ROOT = Context.root("anchor")


def _chunk(key: str) -> Chunk:
    ids = torch.arange(3)
    return Chunk("text", key, ids, ids, 3, torch.zeros(3, dtype=torch.long))


def _edges(state: WindowRecord) -> dict[tuple[str, str], dict[str, object]]:
    """What each edge records (kept on its target's entry), checked against the graph's edges."""
    recorded = {
        (source.key, ref.key): {"index": index, "state": digest}
        for ref in state.entries
        for source, index, digest in state.recorded(ref)
    }
    assert set(recorded) == {(a.key, b.key) for a, b in state.graph.edges}
    return recorded


def _chained(state: WindowRecord, keys: list[str]) -> None:
    """Each chunk's state patched over the ones before it, its in-edges set to match."""
    refs = {ref.key: ref for ref in state.entries}
    context = ROOT
    for i, key in enumerate(keys):
        ref = refs[key]
        state.entries[ref].state = (
            ChunkState.patched(key, "full", context) if i else ChunkState.canonical(key, ROOT)
        )
        context = context.extend(state.entries[ref].state)
        state.set_antecedents(ref, [refs[k] for k in keys[:i]])


def _window(keys: list[str]) -> WindowRecord:
    state = WindowRecord()
    for key in keys:
        chunk = _chunk(key)
        ref = state.mint(chunk, None)
        state.add(ref, Entry(chunk, ChunkState.canonical(key, ROOT)))
        state.order.append(ref)
    _chained(state, keys)
    return state


def test_a_snapshot_keeps_its_edges_while_the_live_state_rewrites_them() -> None:
    live = _window(["a", "b", "c", "d"])
    snapshot = live.copy()
    before = _edges(snapshot)
    assert before[("a", "d")]["index"] == 0 and len(before) == 6
    _chained(live, ["c", "a", "d", "b"])  # a reorder: every edge that stays is re-stated
    after = _edges(live)
    assert after != before and after[("c", "a")]["index"] == 0 and ("a", "c") not in after
    assert _edges(snapshot) == before  # nothing the live state wrote shows in the snapshot
    _chained(snapshot, ["a", "b", "d", "c"])  # and the other way round
    assert _edges(live) == after


def test_unchanged_antecedents_leave_a_shared_graph_shared() -> None:
    state = _window(["a", "b", "c"])
    snapshot = state.copy()
    ref = state.order[2]
    state.set_antecedents(ref, state.antecedents_of(ref))
    assert state.graph is snapshot.graph  # nothing written: nothing copied


def test_a_slide_removes_one_edge_per_chunk_and_re_records_the_rest() -> None:
    """Why: a slide moves every chunk one antecedent down; each edge that stays records a new
    index and state (on the entry), and only the edges from the chunk that left go."""
    live = _window(["a", "b", "c", "d"])
    snapshot = live.copy()
    first = live.order.pop(0)
    _chained(live, ["b", "c", "d"])
    after = _edges(live)
    assert set(after) == {("b", "c"), ("b", "d"), ("c", "d")}
    assert after[("b", "d")]["index"] == 0 and after[("c", "d")]["index"] == 1
    b, d = live.order[0], live.order[2]
    assert after[("b", "d")]["state"] == live.entries[b].state.digest  # b's state as it is now
    assert live.entries[d].state.context.states()[0] == live.entries[b].state
    assert _edges(snapshot)[("b", "d")]["index"] == 1 and first in snapshot.graph.pred[d]


def test_forgetting_and_adding_chunks_in_a_snapshot_leaves_the_other_side_as_it_was() -> None:
    live = _window(["a", "b", "c", "d"])
    snapshot = live.copy()
    before, nodes = _edges(snapshot), set(snapshot.graph)
    gone = live.order.pop(1)
    live.remove(gone)  # b: its node and its edges both ways
    chunk = _chunk("e")
    fresh = live.mint(chunk, None)
    live.add(fresh, Entry(chunk, ChunkState.canonical("e", ROOT)))
    live.order.append(fresh)
    _chained(live, ["a", "c", "d", "e"])
    assert gone not in live.graph and fresh in live.graph
    assert not any("b" in pair for pair in _edges(live)) and ("a", "e") in _edges(live)
    assert _edges(snapshot) == before and set(snapshot.graph) == nodes  # untouched
    assert snapshot.graph.pred[gone] and snapshot.graph.succ[gone]


def test_a_write_after_a_snapshot_copies_only_the_adjacency_of_the_nodes_it_changes() -> None:
    """Why: a long session's graph keeps every evicted chunk (up to max_evicted) with its edges;
    an op that copied all of them before its first write grew slower as the session grew."""
    live = _window(["a", "b", "c", "d"])
    snapshot = live.copy()
    d = live.order[3]
    live.set_antecedents(d, live.order[:2])  # d loses its edge from c
    a, c = live.order[0], live.order[2]
    assert live.graph._pred[d] is not snapshot.graph._pred[d]  # written: its own copy
    assert live.graph._adj[c] is not snapshot.graph._adj[c]
    assert live.graph._pred[c] is snapshot.graph._pred[c]  # untouched: still shared
    assert live.graph._adj[a] is snapshot.graph._adj[a]  # a's edge to d kept as it was
    assert (c, d) in snapshot.graph.edges and (c, d) not in live.graph.edges
