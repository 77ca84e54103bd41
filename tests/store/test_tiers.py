"""The `Tier` protocol: the store asks its tiers in order through it alone, and tells apart a tier
that did not answer from one that does not hold an entry.

The test double is `kamera_agent.testing.FakeTier` (shipped, like httpx's MockTransport): a
dictionary of encoded entries that can be told to stop answering, so the store's walk, its one
decode/verify path and its counting are tested without a server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from kamera_agent.errors import ForeignChunkError
from kamera_agent.store import ChunkStore, EntryKey
from kamera_agent.store.codec import header_info
from kamera_agent.store.memory import MemoryTier
from kamera_agent.store.tier import Entry, Lookup, Meta, Payload, Status, Tier, Write
from kamera_agent.testing import FakeTier
from tests.store.test_chunk_store import FP, OTHER_FP, make_kv, make_patch


def test_a_tier_that_does_not_answer_is_an_outage_not_an_absence() -> None:
    fake = FakeTier()
    store = ChunkStore(fingerprint=FP, memory_limit=3_000, tiers=[fake])  # one 2,048-byte canonical
    first, second = make_kv("first", 4, seed=1), make_kv("second", 4, seed=2)
    store.put_canonical(first)
    store.put_canonical(second)  # drops `first` from memory; the fake still holds both
    assert set(fake.data) == {EntryKey.canonical("first"), EntryKey.canonical("second")}

    fake.down = True
    assert store.get_canonical("first") is None  # the caller computes it: no crash, no wait
    assert not store.has_canonical("first")
    stats = store.stats()
    assert (stats.misses, stats.unavailable, stats.hits) == (1, 2, 0)
    assert fake.rejected == [] and EntryKey.canonical("first") in fake.data  # nothing taken as gone

    fake.down = False  # back: the entry it held all along is served, verified and promoted
    got = store.get_canonical("first")
    assert got is not None and torch.equal(got.keys, first.keys) and got.model_fingerprint == FP
    stats = store.stats()
    assert (stats.hits, stats.memory_entries, stats.unavailable) == (1, 1, 2)
    assert store.get_canonical("first") is not None and store.stats().memory_hits == 1


def test_tiers_are_asked_in_the_order_given_and_the_first_hit_wins() -> None:
    calls: list[str] = []
    upper, lower = FakeTier(calls, "upper"), FakeTier(calls, "lower")
    store = ChunkStore(fingerprint=FP, memory_limit=1 << 20, tiers=[upper, lower])
    only_lower, both = make_kv("only lower", 2, seed=1), make_kv("both", 2, seed=2)
    lower.put(Entry(EntryKey.canonical("only lower"), only_lower, only_lower.nbytes, FP))
    for tier, value in ((upper, both), (lower, make_kv("both", 2, seed=3))):
        tier.put(Entry(EntryKey.canonical("both"), value, value.nbytes, FP))

    got = store.get_canonical("both")
    assert got is not None and torch.equal(got.keys, both.keys) and calls == ["upper.get"]
    calls.clear()
    got = store.get_canonical("only lower")
    assert got is not None and torch.equal(got.keys, only_lower.keys)
    assert calls == ["upper.get", "lower.get"]
    calls.clear()
    assert store.get_canonical("nowhere") is None and calls == ["upper.get", "lower.get"]
    calls.clear()
    assert store.has_canonical("only lower") and calls == []  # promoted: memory answers
    lower.put(Entry(EntryKey.canonical("lower too"), only_lower, only_lower.nbytes, FP))
    assert store.has_canonical("lower too") and calls == ["upper.contains", "lower.contains"]
    assert store.stats().hits == 2 and store.stats().misses == 1


def test_every_tier_takes_a_put_and_serves_a_patch_peek() -> None:
    fake = FakeTier()
    store = ChunkStore(fingerprint=FP, memory_limit=10_000, tiers=[fake])
    patch = make_patch("chunk", "s" * 64, 4, 2)
    store.put_patch(patch)
    assert store.patch_info("chunk", "s" * 64) == (patch.state, patch.meta)  # from memory
    reader = ChunkStore(fingerprint=FP, memory_limit=10_000, tiers=[fake])
    assert reader.patch_info("chunk", "s" * 64) == (patch.state, patch.meta)  # from the fake's header
    assert reader.stats().hits == 0  # a peek is not a use


@pytest.mark.parametrize("keyed_by_model", [True, False])
def test_one_verify_path_for_every_tier(keyed_by_model: bool) -> None:
    """Bytes from any tier are decoded and checked; a foreign model's value is damage in a tier whose
    keys name the model (rejected), a configuration mistake otherwise (a named error)."""
    fake = FakeTier()
    fake.keyed_by_model = keyed_by_model  # type: ignore[misc]
    foreign = replace(make_kv("chunk", 2), model_fingerprint=OTHER_FP)
    fake.put(Entry(EntryKey.canonical("chunk"), foreign, foreign.nbytes, OTHER_FP))
    misfiled = make_kv("elsewhere", 2)
    fake.data[EntryKey.canonical("misfiled")] = Entry(
        EntryKey.canonical("elsewhere"), misfiled, misfiled.nbytes, FP
    ).serialize()
    store = ChunkStore(fingerprint=FP, memory_limit=10_000, tiers=[fake])

    assert store.get_canonical("misfiled") is None  # holds another address: never served
    (key, why), *_ = fake.rejected
    assert key == EntryKey.canonical("misfiled") and "holds canonical:elsewhere" in why
    if keyed_by_model:
        assert store.get_canonical("chunk") is None
        assert fake.rejected[1] == (EntryKey.canonical("chunk"), f"made by model {OTHER_FP[:16]}…")
    else:
        with pytest.raises(ForeignChunkError, match=f"made by model {OTHER_FP[:16]}"):
            store.get_canonical("chunk")
        assert len(fake.rejected) == 1 and EntryKey.canonical("chunk") in fake.data  # left alone


class _Counting(Tier):
    """Only the single methods: the batched ones come from the protocol's defaults."""

    name = "counting"

    def __init__(self) -> None:
        self.asked: list[str] = []

    def get(self, key: EntryKey) -> Lookup[Payload]:
        self.asked.append(f"get {key.key}")
        return Lookup.hit(b"bytes") if key.key == "held" else Lookup.miss()

    def put(self, entry: Entry) -> Write:
        return Write(False, "read-only")

    def contains(self, key: EntryKey) -> Status:
        self.asked.append(f"contains {key.key}")
        return {"held": Status.HIT, "away": Status.UNAVAILABLE}.get(key.key, Status.MISS)

    def drop(self, key: EntryKey) -> None:
        return None

    def peek(self, key: EntryKey) -> Lookup[Meta]:
        return Lookup.miss()


def test_batched_methods_fall_back_to_the_single_ones() -> None:
    tier = _Counting()
    keys: Sequence[EntryKey] = [EntryKey.canonical(k) for k in ("held", "absent", "away")]
    assert [found.status for found in tier.get_many(keys)] == [Status.HIT, Status.MISS, Status.MISS]
    assert tier.get_many(keys)[0].found == b"bytes"
    assert tier.contains_many(keys) == [Status.HIT, Status.MISS, Status.UNAVAILABLE]
    assert tier.asked == [
        *("get held", "get absent", "get away") * 2,
        *("contains held", "contains absent", "contains away"),
    ]
    assert tier.get_many([]) == [] and tier.keys() == []  # a tier lists nothing unless it can


def test_memory_is_a_tier_and_a_tier_needs_a_name() -> None:
    memory = MemoryTier(10_000, lambda info: float(info.last_used))
    patch = make_patch("chunk", "s" * 64, 2, 1)
    key = EntryKey.patch("chunk", patch.state)
    assert memory.contains(key) is Status.MISS and memory.get(key).status is Status.MISS
    assert memory.put(Entry(key, patch, 96, FP)).ok
    assert memory.get(key) == Lookup(Status.HIT, patch)
    assert memory.peek(key) == Lookup.hit(header_info("patch", patch))
    memory.drop(key)
    assert memory.contains_many([key]) == [Status.MISS]
    with pytest.raises(TypeError, match="needs a name"):

        class Nameless(FakeTier):
            name = ""
