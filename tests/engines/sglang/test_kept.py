"""A kept load the tree evicts is forgotten (run in .venv-sglang).

Under ``survivors="keep"`` a chunk loaded in a state a forward would not compute is remembered,
so a later request that finds its tokens in SGLang's tree chains the state they hold. When
SGLang evicts those tokens (memory pressure in its real allocator -> ``RadixCache.evict``), a
request computing them again holds what a forward gives: the memory must say so, or that exact
KV is filed under the approximate name. The store's own budget evicting every entry (a filler
entry as large as it) is what makes SGLang compute the tokens instead of loading them again.
"""

from __future__ import annotations

from typing import Any

import torch

from kamera_agent.config import WindowConfig
from kamera_agent.core.identity import ChunkState
from kamera_agent.engines.sglang.segments import request_chunks
from kamera_agent.engines.synthesis import KeptLoad, PrefixSynthesis
from kamera_agent.operator.layout import ChunkKV, to_position_free
from kamera_agent.store import EntryKey
from tests.engines.sglang.harness import Admission
from tests.engines.sglang.test_radix import EXACT, Prompt, _backend, _part, _rel, _run, _setup, move_a_chunk

STORE = 8 << 20


def _nothing(*args: Any) -> None:
    """A forward whose KV no assertion reads (a filler's)."""


def _kept_load() -> tuple[Admission, Any, Prompt, KeptLoad, torch.Tensor]:
    """A chunk captured behind one prefix, loaded behind another in that kept state; returns the
    harness, the model, the prompt, the load's record and the tree's slots of the loaded chunk."""
    backend = _backend("qwen2")
    harness, model = _setup(backend, 1, WindowConfig(drift_budget=None), size=640, store_budget=STORE)
    cache = harness.tree_cache
    now, req = move_a_chunk(harness, model)
    start, end = now.bounds[2]
    assert cache.stats.loads == 1 and req.prefix_len == end
    slots = harness.row(req)[start:end].clone()
    harness.drain()
    (load,) = cache.synthesis.kept_loads
    assert (load.chunk.start, load.chunk.end, load.tokens) == (start, end, end - start)
    assert load.state != load.computed  # served in its kept state: not what a forward gives
    assert len(cache.kept_slots) == end - start
    return harness, model, now, load, slots


def _store_forgets_everything(cache: Any) -> None:
    """The store's budget evicts every entry (one entry as large as the budget is written)."""
    filler = torch.zeros(1, 1, STORE // 8, 1)
    cache.synthesis.write(EntryKey.canonical("filler"), ChunkKV(filler, filler.clone()))


def test_a_kept_load_the_tree_evicted_is_forgotten_and_its_tokens_computed_again_are_exact() -> None:
    harness, model, now, load, _ = _kept_load()
    cache = harness.tree_cache
    # memory pressure: a prompt the pool holds only once SGLang evicted the whole tree
    size = harness.free_slots() + cache.evictable_size() - 8
    filler = harness.request([20 + i % 50 for i in range(size)])
    assert harness.admit([filler]) == [filler]
    harness.prefill(_nothing)
    assert cache.total_size() == size  # the filler alone: every other slot was evicted
    assert cache.synthesis.kept_loads == () and len(cache.kept_slots) == 0

    _store_forgets_everything(cache)
    again = _run(harness, model, now, "again")
    assert again.prefix_len == 0 and cache.stats.loads == 1  # computed by the forward, all of it
    harness.drain()
    # the chunk computed again is filed under the state a forward gives it, and chained on
    namespace = f"|{model.salt}"  # kept states are served only under a client's salt
    chunks = request_chunks(now.tokens, cache.rules, namespace)
    exact = PrefixSynthesis(cache.synthesis.store, "exact")
    plan = exact.plan(namespace, chunks, 0, len(now.tokens))
    assert [item.chunk for item in plan.served] == chunks
    kvs = exact.load(plan).kvs
    assert kvs
    moved = chunks.index(load.chunk)
    want = to_position_free(_part(now.kv, load.chunk.start, load.chunk.end), model.backend.layout)
    assert _rel(kvs[moved].keys, want.keys) < EXACT and _rel(kvs[moved].values, want.values) < EXACT
    assert not cache.synthesis.store.contains(EntryKey.full(load.chunk.key, load.state.digest))
    harness.evict_all()
    assert harness.free_slots() == harness.capacity
    harness.check()


def test_a_kept_load_whose_tail_the_tree_evicted_keeps_its_head() -> None:
    harness, model, now, load, slots = _kept_load()
    cache = harness.tree_cache
    start, end = now.bounds[2]
    head = (end - start) // 2
    # a request sharing the load's first tokens makes SGLang split the load's node there
    branch = harness.request([*now.tokens[: start + head], 7, 8, 9])
    branch.cache_salt = model.salt  # the load's namespace
    assert harness.admit([branch]) == [branch] and branch.prefix_len == start + head
    harness.prefill(_nothing)
    # the oldest leaves go first, one at a time, until the load's tail is gone: its head stays
    while set(slots[head:].tolist()) & set(harness.tree_slots().tolist()):
        assert harness.evict(1) > 0
    assert set(slots[:head].tolist()) <= set(harness.tree_slots().tolist())
    (kept,) = cache.synthesis.kept_loads
    assert kept == KeptLoad(load.prefix, load.chunk, load.state, load.computed, head)
    assert len(cache.kept_slots) == head

    _store_forgets_everything(cache)
    again = _run(harness, model, now, "again")
    assert again.prefix_len == start + head and cache.stats.loads == 1  # the rest is computed
    harness.drain()
    # the chunk is its kept head and a forward's tail: captured under that splice, not the kept name
    spliced = ChunkState.spliced(load.state, load.computed, head)
    store = cache.synthesis.store
    assert store.contains(EntryKey.full(load.chunk.key, spliced.digest))
    assert not store.contains(EntryKey.full(load.chunk.key, load.state.digest))
    harness.evict_all()
    assert cache.synthesis.kept_loads == () and len(cache.kept_slots) == 0
    assert harness.free_slots() == harness.capacity
    harness.check()


def test_a_tree_reset_forgets_every_kept_load() -> None:
    harness, *_ = _kept_load()
    cache = harness.tree_cache
    with harness.active():
        cache.reset()  # what SGLang's flush_cache does to the tree (before clearing the allocator)
    assert cache.synthesis.kept_loads == () and len(cache.kept_slots) == 0
