"""`ChunkStore.put_many` (an operation's commit): the same entries, evictions and events as one
put each, entries too large for a budget skipped and counted, and a batch that fails a check
stores nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kamera_agent.errors import ForeignChunkError, StoreKeyError
from kamera_agent.operator import ChunkKV
from kamera_agent.store import ChunkStore, EntryKey
from kamera_agent.store.codec import StoredValue, content_digest, entry_nbytes
from kamera_agent.testing import FakeTier
from tests.store.test_chunk_store import FP, OTHER_FP, make_kv, make_patch, make_vision


def _entries() -> list[tuple[EntryKey, StoredValue]]:
    kv = make_kv("a", 8)
    patch = make_patch("a", "s" * 64, 8, 2, seed=1)
    return [
        (EntryKey.canonical("a"), kv),
        (EntryKey.full("b", "t" * 64), make_kv("b", 12, seed=2)),
        (EntryKey.vision("v"), make_vision(6)),
        (EntryKey.patch("a", "o" * 64), patch),
        (EntryKey.canonical("c"), make_kv("c", 10, seed=3)),
        (EntryKey.canonical("a"), make_kv("a", 8, seed=4)),  # the same address again: replaced
    ]


def _store(path: Path, fake: FakeTier) -> ChunkStore:
    budget = 2 * make_kv("x", 12).nbytes  # tight: the batch evicts as it goes
    return ChunkStore(fingerprint=FP, memory_limit=budget, disk_dir=path, disk_limit=1 << 20, tiers=[fake])


def test_a_batch_stores_what_one_put_each_stores(tmp_path: Path) -> None:
    one, many = FakeTier(label="one"), FakeTier(label="many")
    by_put, batched = _store(tmp_path / "put", one), _store(tmp_path / "many", many)
    for key, value in _entries():
        by_put.put(key, value)
    done = batched.put_many(_entries())
    assert (done.stored, done.too_large) == (6, 0)
    assert done.nbytes == sum(entry_nbytes(key.kind, value) for key, value in _entries())
    assert batched.stats() == by_put.stats()
    assert [(e.kind, e.key) for e in batched.events()] == [(e.kind, e.key) for e in by_put.events()]
    assert batched.keys() == by_put.keys() and set(many.data) == set(one.data)
    for key in batched.keys():  # noqa: SIM118  (a store is not a mapping)
        a, b = batched.get(key), by_put.get(key)
        assert a is not None and b is not None and content_digest(key, a, FP) == content_digest(key, b, FP)


def test_entries_too_large_for_a_budget_are_skipped_and_counted() -> None:
    small, large = make_kv("a", 4), make_kv("b", 64)
    store = ChunkStore(fingerprint=FP, memory_limit=large.nbytes - 1)
    done = store.put_many([(EntryKey.canonical("b"), large), (EntryKey.canonical("a"), small)])
    assert (done.stored, done.nbytes, done.too_large) == (1, small.nbytes, 1)
    assert store.has_canonical("a") and not store.has_canonical("b")


def _foreign() -> ChunkKV:
    kv = make_kv("f", 4)
    return ChunkKV(kv.keys, kv.values, None, "f", OTHER_FP)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ((EntryKey.canonical(""), make_kv("", 4)), StoreKeyError),  # no content key
        ((EntryKey.canonical("f"), _foreign()), ForeignChunkError),
        ((EntryKey.vision("v"), {"__metadata__": make_vision(2)["embeds"]}), StoreKeyError),
    ],
)
def test_a_batch_that_fails_a_check_stores_nothing(
    bad: tuple[EntryKey, StoredValue], error: type[Exception]
) -> None:
    store = ChunkStore(fingerprint=FP, memory_limit=1 << 20)
    with pytest.raises(error):
        store.put_many([(EntryKey.canonical("a"), make_kv("a", 4)), bad])
    assert store.keys() == [] and store.stats().puts == 0
