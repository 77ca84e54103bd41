"""The request lifecycle every engine adapter calls (`kamera_agent.engines.lifecycle`), alone.

The adapters' own suites (tests/engines/sglang, tests/engines/vllm) run it inside the engines;
here each step is checked on plain values, so an adapter for another engine can rely on it.
"""

from __future__ import annotations

import logging

import torch

from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.engines import lifecycle
from kamera_agent.engines.chunking import keyed
from kamera_agent.engines.faults import HookFaults
from kamera_agent.engines.lifecycle import EngineRequest, ServedReport
from kamera_agent.engines.synthesis import EngineStats, LoadPlan, PrefixSynthesis, RequestChunk, Served
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import ChunkStore, EntryKey

ROOT = Context.root("anchor")


def _plan() -> LoadPlan:
    """Tokens 40..96 loaded: chunk a (32..64) after an engine hit of 40, chunk b (64..100) in a
    kept state, cut at 96; 5 tokens of the engine's hit were left kept by an earlier load."""
    first, second = RequestChunk(32, 64, "a"), RequestChunk(64, 100, "b")
    computed_b = ChunkState.patched("b", "full", ROOT.extend(ChunkState.canonical("a", ROOT)))
    kept_b = ChunkState.patched("b", "full", ROOT.extend(ChunkState.canonical("x", ROOT)))
    served = (
        Served(first, ChunkState.canonical("a", ROOT), EntryKey.canonical("a"), skip=8),
        Served(second, kept_b, EntryKey.full("b", kept_b.digest), 0, computed_b, 0.02),
    )
    return LoadPlan(40, 96, served, held_kept=5, held_drift=0.01, refused=True)


def test_a_namespace_joins_the_engines_scope_and_the_salt_and_is_empty_for_neither() -> None:
    assert lifecycle.namespace_of("", "") == ""  # a window's chunks' namespace: shared entries
    assert lifecycle.namespace_of("lora", "") == "lora|"
    assert lifecycle.namespace_of("", "salt") == "|salt"
    assert lifecycle.namespace_of("lora", "salt") != lifecycle.namespace_of("salt", "lora")


def test_the_pieces_of_a_plan_cover_its_tokens_exactly() -> None:
    spans = lifecycle.load_spans(_plan())
    assert [(s.start, s.end, s.entry_from, s.entry_to) for s in spans] == [(40, 64, 8, 32), (64, 96, 0, 32)]
    assert sum(s.end - s.start for s in spans) == _plan().tokens


def test_the_report_counts_loaded_and_kept_tokens_and_a_failed_load_loaded_nothing() -> None:
    report = ServedReport.of(_plan())
    assert report == ServedReport(56, 32 + 5, 0.02, True)
    assert report.as_dict() == {"loaded_tokens": 56, "kept_tokens": 37, "drift": 0.02, "kept_refused": True}
    assert ServedReport.of(_plan(), failed=True) == ServedReport(0, 5, 0.01, True)  # the engine's hit only
    assert ServedReport.of(None) == ServedReport(0, 0, 0.0, False)
    text = report.describe()
    assert text.startswith("loaded 56 prompt tokens, 37 kept (approximate), largest drift 0.02")
    assert "refused" in text and "refused" not in ServedReport.of(None).describe()
    assert "largest drift unknown" in ServedReport(1, 1, None).describe()


def test_offers_and_writes_are_counted_where_each_adapter_makes_them() -> None:
    stats = EngineStats()
    lifecycle.count_offer(stats, _plan())
    lifecycle.count_written(stats, 24)
    lifecycle.count_written(stats, 32, chunks=2)
    assert (stats.offered, stats.tokens_offered, stats.tokens_kept) == (1, 56, 32)
    assert (stats.loads, stats.chunks_loaded, stats.tokens_loaded) == (2, 3, 56)


def test_an_entry_the_store_lost_and_one_it_cannot_read_are_faults_of_their_own_kinds() -> None:
    store = ChunkStore(fingerprint="f" * 64, memory_limit=1 << 20)
    held, gone = EntryKey.canonical("held"), EntryKey.canonical("gone")
    store.put(held, ChunkKV(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), None, "held"))
    faults = HookFaults(logging.getLogger("t"))
    lifecycle.count_unloadable(faults, store, "hook", "r", [held, gone, gone])
    assert faults.as_dict() == {"hook:UnreadableEntry": 1, "hook:LostEntry": 2}


def test_a_request_plans_approximations_only_under_its_salt() -> None:
    """The store holds the last chunk only in the state it was captured in behind another middle
    chunk (a kept state): served to the salted request, never to the unsalted one, whose load
    would enter the engine's shared prefix cache as if computed."""
    anchor, middle, last = list(range(8)), list(range(100, 108)), list(range(200, 216))
    before = keyed(anchor + middle + last, [(0, 8, "text"), (8, 16, "text"), (16, 32, "text")])
    now = keyed(anchor + last, [(0, 8, "text"), (8, 24, "text")])
    assert before[2].key == now[1].key  # the same message behind the same anchor
    synthesis = PrefixSynthesis(ChunkStore(fingerprint="f" * 64, memory_limit=1 << 20), "keep")

    def read(chunk: RequestChunk) -> ChunkKV:
        return ChunkKV(torch.zeros(1, 1, len(chunk), 4), torch.zeros(1, 1, len(chunk), 4))

    assert EngineRequest("", before).capture(synthesis, 32, read) == 3
    salted, plain = EngineRequest("", now, salted=True), EngineRequest("", now)
    assert salted.plan(synthesis, 8, 24).tokens == 16
    assert plain.plan(synthesis, 8, 24).tokens == 0
    assert [chunk.start for chunk, _, _ in plain.captures(synthesis, 24)] == [8]  # its exact state: new
