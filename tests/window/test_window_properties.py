"""Property tests: random sequences of push / reorder / slide / evict / recall / fork.

After every step the window must stay consistent: positions follow the order, the antecedent
graph is acyclic, causal and matches the window, no chunk is ever lost (every evicted chunk is
recallable, even when the store's budget drops its canonical: then it is re-encoded and the
stats say so), and an op that fails leaves window and store unchanged.
"""

from __future__ import annotations

from functools import cache

import networkx as nx
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kamera_agent.backends import TransformersBackend
from kamera_agent.config import WindowConfig
from kamera_agent.errors import KameraError
from kamera_agent.store import ChunkStore
from kamera_agent.window import KameraWindow
from kamera_agent.window.costs import CostMeter
from tests.backends.test_transformers_backend import text_backend

TEXTS = ["red", "green ball", "blue box moves", "a cat", "the dog sat", "yellow"]


@cache
def shared_backend() -> TransformersBackend:
    return text_backend("qwen2")


class WindowMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        backend = shared_backend()
        # A small store: canonicals and patches get dropped, so recalls must re-encode.
        backend.store = ChunkStore(fingerprint=backend.fingerprint, memory_budget=120_000)
        self.window = KameraWindow(backend, config=self.config())
        self.pushed: set = set()

    @staticmethod
    def config() -> WindowConfig:
        return WindowConfig(rank=4, capacity_chunks=5)

    @rule(text=st.sampled_from(TEXTS))
    def push(self, text: str) -> None:
        self.pushed.add(self.window.push(text, label=text))

    @precondition(lambda self: len(self.window) > 1)
    @rule(data=st.data())
    def reorder(self, data: st.DataObject) -> None:
        self.window.reorder(data.draw(st.permutations(self.window.refs)))

    @rule(n=st.integers(0, 2))
    def slide(self, n: int) -> None:
        before = self.window.refs
        assert self.window.slide(n) == before[:n]

    @precondition(lambda self: len(self.window) > 0)
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        self.window.evict(data.draw(st.sampled_from(self.window.refs)))

    @precondition(lambda self: len(self.window.evicted) > 0)
    @rule(data=st.data())
    def recall(self, data: st.DataObject) -> None:
        ref = data.draw(st.sampled_from(sorted(self.window.evicted)))
        at = data.draw(st.none() | st.integers(0, len(self.window)))
        self.window.recall(ref, at=at)
        assert ref in self.window.refs

    @rule()
    def fork(self) -> None:
        branch = self.window.fork()
        if branch.refs:
            branch.slide()
        assert self.window.refs != branch.refs or not branch.refs

    @rule(data=st.data())
    def failing_op_changes_nothing(self, data: st.DataObject) -> None:
        before = self._snapshot()
        bad = data.draw(st.sampled_from(["recall-in-window", "duplicate", "foreign"]))
        try:
            if bad == "recall-in-window" and self.window.refs:
                self.window.recall(self.window.refs[0])
            elif bad == "duplicate" and self.window.refs:
                self.window.reorder([self.window.refs[0], *self.window.refs])
            else:
                other = KameraWindow(shared_backend(), config=WindowConfig(rank=4))
                self.window.evict(other.push("stranger"))
        except KameraError:
            pass
        assert self._snapshot() == before

    def _snapshot(self) -> tuple:
        w = self.window
        return (w.refs, sorted(w.evicted), sorted(w.graph.edges), [id(w.patch_of(r)) for r in w.refs])

    @invariant()
    def placed_kv_sits_where_the_order_puts_it(self) -> None:
        w = self.window
        meter = CostMeter(w.backend.counters)
        position = w.backend.anchor.advance
        for ref in w.refs:
            placed = w._placed_kv(ref, meter)  # the (memoised) KV the next ask will use
            assert placed.positions is not None
            assert torch.equal(placed.positions, w.chunk(ref).relative_positions + position)
            position += w.chunk(ref).advance
        assert w._end() == position

    @invariant()
    def graph_is_acyclic_causal_and_matches_the_window(self) -> None:
        w = self.window
        graph = w.graph
        assert nx.is_directed_acyclic_graph(graph)
        assert set(graph.nodes) == self.pushed
        for ref in graph.nodes:
            assert graph.nodes[ref]["in_window"] == (ref in w.refs)
        order = {ref: i for i, ref in enumerate(w.refs)}
        for source, target in graph.edges:
            if source in order and target in order:
                assert order[source] < order[target], "a KV may only encode chunks to its left"

    @invariant()
    def no_chunk_is_lost(self) -> None:
        w = self.window
        assert set(w.refs) | set(w.evicted) == self.pushed
        assert len(set(w.refs)) == len(w.refs) <= (w.config.capacity_chunks or 0)
        for ref in w.evicted:
            assert w.chunk(ref).num_tokens > 0  # recallable: its chunk (and so its canonical) survives

    def teardown(self) -> None:
        for ref in sorted(self.window.evicted):  # every evicted chunk comes back
            self.window.recall(ref)
            assert ref in self.window.refs
        cache_kv = self.window.kv()
        slots = self.window.backend.anchor.num_tokens + sum(
            self.window.chunk(r).num_tokens for r in self.window.refs
        )
        assert cache_kv.get_seq_length() == slots
        assert torch.isfinite(cache_kv.layers[-1].keys).all()


TestWindowProperties = WindowMachine.TestCase
TestWindowProperties.settings = settings(
    max_examples=200, stateful_step_count=8, deadline=None, suppress_health_check=list(HealthCheck)
)


class OtherPoliciesMachine(WindowMachine):
    """The same invariants under the other policies: lazy patches, recall on the current left
    context, no cascade, reorders that keep, probe-free LRU eviction, survivors re-patched."""

    @staticmethod
    def config() -> WindowConfig:
        return WindowConfig(
            rank=4,
            capacity_chunks=4,
            patch_mode="lazy",
            recall_context="current",
            cascade="keep",
            reorder="keep",
            eviction="lru",
            survivors="removal",
            orbit=False,
        )


TestOtherPolicies = OtherPoliciesMachine.TestCase
TestOtherPolicies.settings = settings(
    max_examples=60, stateful_step_count=8, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_budget_forced_re_encodes_are_reported() -> None:
    backend = shared_backend()
    backend.store = ChunkStore(fingerprint=backend.fingerprint, memory_budget=40_000)
    w = KameraWindow(backend, config=WindowConfig(rank=4))
    refs = [w.push(text, label=text) for text in TEXTS]
    w.slide(len(refs))
    for ref in refs:
        w.recall(ref)
    assert w.stats.total.reencodes > 0
    assert w.refs == refs
