"""The ChunkStore: budgets hold, nothing is lost silently, disk files are verified and survive."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import subprocess
import sys
import threading
import zlib
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from kamera_agent.errors import (
    ForeignChunkError,
    ForeignPatchError,
    StoreDirectoryError,
    StoreKeyError,
    StoreLimitError,
)
from kamera_agent.operator import ChunkKV, Patch
from kamera_agent.store import EVICTION_POLICIES, ChunkStore, DriftAudit, EntryKey

FP = "ab" * 32
OTHER_FP = "cd" * 32
ROOT = Path(__file__).resolve().parents[2]
Value = ChunkKV | Patch | dict[str, torch.Tensor]


# --- entries ------------------------------------------------------------------------------


def _gen(key: EntryKey, version: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{key}|{version}".encode()))


def make_kv(key: str, n: int, *, seed: int = 0, dtype: torch.dtype = torch.float32, rows: int = 0) -> ChunkKV:
    """A canonical of ``n`` tokens: keys and values ``[2, 2, n, 16]``; ``rows`` 1 or 3 adds positions."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 2, n, 16, generator=g).to(dtype)
    values = torch.randn(2, 2, n, 16, generator=g).to(dtype)
    positions = None if rows == 0 else torch.arange(n * rows).view(rows, n).squeeze(0)
    return ChunkKV(keys, values, positions, key, FP)


def make_vision(n: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Vision tower outputs: embeddings ``[n, 32]`` and deepstack features ``[3, n, 32]``."""
    g = torch.Generator().manual_seed(seed)
    return {"embeds": torch.randn(n, 32, generator=g), "deepstack": torch.randn(3, n, 32, generator=g)}


def make_patch(key: str, state: str, n: int, rank: int, *, seed: int = 0) -> Patch:
    """Factors ``u [n, m]``, ``v [m, 64]`` for 2 layers × 2 slots."""
    g = torch.Generator().manual_seed(seed)
    factors = {
        (layer, slot): (torch.randn(n, rank, generator=g), torch.randn(rank, 64, generator=g))
        for layer in range(2)
        for slot in ("keys", "values")
    }
    kind: Literal["exact", "orbit"] = "orbit" if seed % 2 else "exact"
    return Patch(factors, n, key, state, FP, kind, {"rank": str(rank)})


def build(key: EntryKey, version: int) -> Value:
    """The entry a test puts at ``key``: its content depends only on (key, version)."""
    g = _gen(key, version)
    n = int(torch.randint(1, 25, (1,), generator=g))
    seed = int(torch.randint(0, 2**31, (1,), generator=g))
    if key.kind == "canonical":
        return make_kv(key.key, n, seed=seed, rows=seed % 2)
    if key.kind == "vision":
        return make_vision(n, seed=seed)
    return make_patch(key.key, key.variant, n, 1 + seed % 4, seed=seed)


def put(store: ChunkStore, key: EntryKey, value: Value) -> None:
    if isinstance(value, ChunkKV):
        store.put_canonical(value)
    elif isinstance(value, Patch):
        store.put_patch(value)
    else:
        store.put_vision(key.key, value)


def get(store: ChunkStore, key: EntryKey) -> Value | None:
    if key.kind == "canonical":
        return store.get_canonical(key.key)
    if key.kind == "vision":
        return store.get_vision(key.key)
    return store.get_patch(key.key, key.variant)


def tensors_of(value: Value) -> dict[str, torch.Tensor]:
    if isinstance(value, ChunkKV):
        out = {"keys": value.keys, "values": value.values}
        return out if value.positions is None else {**out, "positions": value.positions}
    if isinstance(value, Patch):
        return {
            f"{layer}.{slot}.{part}": t
            for (layer, slot), uv in value.factors.items()
            for part, t in zip("uv", uv, strict=True)
        }
    return value


def assert_same(got: Value, want: Value) -> None:
    """Exactly what was put: same type, names, dtypes, bits and metadata."""
    assert type(got) is type(want)
    got_t, want_t = tensors_of(got), tensors_of(want)
    assert sorted(got_t) == sorted(want_t)
    for name, tensor in want_t.items():
        assert got_t[name].dtype == tensor.dtype and torch.equal(got_t[name], tensor), name
    if isinstance(got, ChunkKV) and isinstance(want, ChunkKV):
        assert (got.chunk_key, got.model_fingerprint) == (want.chunk_key, FP)
    if isinstance(got, Patch) and isinstance(want, Patch):
        assert (got.num_tokens, got.chunk_key, got.state, got.kind, got.meta) == (
            want.num_tokens,
            want.chunk_key,
            want.state,
            want.kind,
            want.meta,
        )
        assert got.model_fingerprint == FP


def file_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def file_of(store: ChunkStore, key: EntryKey) -> Path:
    assert store.disk_dir is not None
    (path,) = store.disk_dir.glob(f"{key.kind}-{key.digest}.*.safetensors")
    return path


KEYS = (
    [EntryKey.canonical(f"c{i:02d}") for i in range(30)]
    + [EntryKey.vision(f"v{i:02d}") for i in range(15)]
    + [EntryKey.patch(f"c{i:02d}", f"sig{j}") for i in range(8) for j in range(3)]
)


# --- the random walk ----------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "with_disk"), [("lru", True), ("largest_first", True), ("fifo", False)])
def test_random_walk_keeps_budgets_and_explains_every_miss(
    tmp_path: Path, policy: str, with_disk: bool
) -> None:
    memory_limit, disk_limit = 40_000, 120_000
    disk = {"disk_dir": tmp_path / "spill", "disk_limit": disk_limit} if with_disk else {}
    store = ChunkStore(fingerprint=FP, memory_limit=memory_limit, policy=policy, **disk)  # type: ignore[arg-type]
    rng = random.Random(1234)
    put_version: dict[EntryKey, int] = {}
    lost: set[EntryKey] = set()  # put, then pushed out of every tier (an event said so)
    gets = puts = 0
    kinds: Counter[str] = Counter()  # events seen, by kind: the stats must tally the same
    for step in range(1000):
        key = rng.choice(KEYS)
        if rng.random() < 0.45:
            version = rng.randrange(2)  # sometimes new content under an old key: the put must win
            put(store, key, build(key, version))
            put_version[key], puts = version, puts + 1
            lost.discard(key)
        else:
            got, gets = get(store, key), gets + 1
            if got is None:
                assert key not in put_version or key in lost, f"step {step}: {key} missed unexplained"
            else:
                assert key not in lost, f"step {step}: {key} served after it was reported lost"
                assert_same(got, build(key, put_version[key]))
        for event in store.drain_events():
            kinds[event.kind] += 1
            kinds["lost"] += event.lost
            lost |= {event.key} if event.lost else set()
        assert store.contains(key) == (key in put_version and key not in lost)
        stats = store.stats()
        assert stats.memory_bytes <= memory_limit
        assert stats.disk_bytes <= disk_limit
        if with_disk:
            assert stats.disk_bytes == file_bytes(tmp_path / "spill")
    stats = store.stats()
    assert (stats.puts, stats.hits + stats.misses) == (puts, gets) and stats.hits > 0 and stats.misses > 0
    tally = (stats.spills, stats.dropped, stats.disk_evictions, stats.corrupt_dropped, stats.lost)
    assert tally == tuple(kinds[name] for name in ("spill", "drop", "disk_evict", "corrupt", "lost"))
    assert stats.evictions == stats.spills + stats.dropped > 0
    assert set(store.keys()) == {key for key in put_version if key not in lost}
    if with_disk:
        assert stats.spills > 0 and stats.disk_hits > 0 and stats.disk_evictions > 0
    else:
        assert stats.spills == 0 and stats.dropped == stats.lost > 0


# --- disk files: verified, atomic, reloaded -----------------------------------------------


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_spill_file_is_dropped_not_served(tmp_path: Path, damage: str) -> None:
    store = ChunkStore(fingerprint=FP, memory_limit=3_000, disk_dir=tmp_path, disk_limit=100_000)
    first, second = make_kv("first", 4, seed=1), make_kv("second", 4, seed=2)  # 2,048 bytes each
    store.put_canonical(first)
    store.put_canonical(second)  # pushes `first` to disk
    path = file_of(store, EntryKey.canonical("first"))
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        middle = len(blob) // 2
        blob[middle : middle + 8] = bytes(b ^ 0xFF for b in blob[middle : middle + 8])
    else:
        blob = blob[: len(blob) // 2]
    path.write_bytes(bytes(blob))

    assert store.get_canonical("first") is None
    assert not path.exists() and not store.contains(EntryKey.canonical("first"))
    stats = store.stats()
    assert (stats.corrupt_dropped, stats.misses, stats.disk_entries) == (1, 1, 0)
    (event,) = [e for e in store.events() if e.kind == "corrupt"]
    assert event.key == EntryKey.canonical("first") and event.lost
    store.put_canonical(first)  # the caller re-encodes; the store takes it back
    assert_same(store.get_canonical("first"), first)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "content",
    [b"", b"\xff" * 8 + b"junk", b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"],
    ids=["empty", "huge-header", "bad-json"],
)
def test_unreadable_file_is_dropped_when_the_directory_is_reindexed(tmp_path: Path, content: bytes) -> None:
    bogus = tmp_path / f"canonical-{'0' * 32}.{'1' * 64}.safetensors"
    bogus.write_bytes(content)
    crashed, in_flight = tmp_path / ".kamera-crashed.tmp", tmp_path / ".kamera-writing.tmp"
    crashed.write_bytes(b"half a file")
    in_flight.write_bytes(b"another process is writing this")
    os.utime(crashed, (0, 0))  # a crash's leftover is old; a write in flight is not
    store = ChunkStore(fingerprint=FP, memory_limit=10_000, disk_dir=tmp_path, disk_limit=100_000)
    assert not bogus.exists() and not crashed.exists() and in_flight.exists()
    assert store.stats().corrupt_dropped == 1 and store.keys() == []


def _tensor_digest(tensors: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + str(tensors[name].dtype).encode())
        digest.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


_REOPEN_SCRIPT = """
import hashlib, json, sys
from typing import Any

import torch
from kamera_agent.store import ChunkStore

{digest}

budget = 1_000_000
store = ChunkStore(fingerprint=sys.argv[2], memory_limit=budget, disk_dir=sys.argv[1], disk_limit=budget)
stats = store.stats()
found = {{}}
for key in store.keys():
    if key.kind == "canonical":
        kv = store.get_canonical(key.key)
        tensors = {{"keys": kv.keys, "values": kv.values, "positions": kv.positions}}
    elif key.kind == "vision":
        tensors = store.get_vision(key.key)
    else:
        patch = store.get_patch(key.key, key.variant)
        factors = patch.factors.items()
        tensors = {{f"{{l}}.{{s}}.{{p}}": t for (l, s), uv in factors for p, t in zip("uv", uv)}}
    found["|".join([key.kind, key.key, key.variant])] = _tensor_digest(tensors)
print(json.dumps({{"found": found, "disk_entries": stats.disk_entries, "hits": store.stats().disk_hits}}))
"""


@pytest.mark.parametrize("index", ["kept", "deleted"])
def test_new_process_reopens_the_disk_tier(tmp_path: Path, index: str) -> None:
    directory = tmp_path / "store"
    entries: dict[EntryKey, Value] = {
        EntryKey.canonical("page"): make_kv("page", 6, seed=3, rows=3),
        EntryKey.vision("frame"): make_vision(5, seed=4),
        EntryKey.patch("page", "a<b<c"): make_patch("page", "a<b<c", 6, 2, seed=5),
        EntryKey.patch("page", "{a,b,c}"): make_patch("page", "{a,b,c}", 6, 3, seed=6),
    }
    with ChunkStore(fingerprint=FP, memory_limit=8_000, disk_dir=directory, disk_limit=200_000) as store:
        for key, value in entries.items():
            put(store, key, value)
        store.flush()
    if index == "deleted":
        for path in directory.glob("index.sqlite*"):
            path.unlink()
    script = tmp_path / "reopen.py"
    script.write_text(_REOPEN_SCRIPT.format(digest=inspect.getsource(_tensor_digest)))
    run = subprocess.run(
        [sys.executable, str(script), str(directory), FP],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    want = {"|".join([k.kind, k.key, k.variant]): _tensor_digest(tensors_of(v)) for k, v in entries.items()}
    assert report == {"found": want, "disk_entries": 4, "hits": 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 3])
def test_entries_round_trip_through_disk_exactly(tmp_path: Path, dtype: torch.dtype, rows: int) -> None:
    store = ChunkStore(fingerprint=FP, memory_limit=4_000, disk_dir=tmp_path, disk_limit=100_000)
    kv = make_kv("chunk", 5, seed=7, dtype=dtype, rows=rows)
    patch = make_patch("chunk", "", 5, 2, seed=8)
    vision = make_vision(3, seed=9)
    store.put_canonical(kv)
    store.put_patch(patch)
    store.put_vision("chunk", vision)
    audit = DriftAudit("chunk", "state", "left", 0.1 + 1e-17 * rows, rows + 2)
    store.put_audit(audit)
    store.close()  # writes what memory holds, releases the directory
    reopened = ChunkStore(fingerprint=FP, memory_limit=4_000, disk_dir=tmp_path, disk_limit=100_000)
    assert_same(reopened.get_canonical("chunk"), kv)  # type: ignore[arg-type]
    assert_same(reopened.get_patch("chunk", ""), patch)  # type: ignore[arg-type]
    assert_same(reopened.get_vision("chunk"), vision)  # type: ignore[arg-type]
    assert reopened.get_audit("chunk", "state", "left") == replace(audit, model_fingerprint=FP)  # every bit
    assert reopened.get_audit("chunk", "state", "other left") is None
    assert reopened.stats().disk_hits == 4


def test_promotion_respects_the_memory_limit(tmp_path: Path) -> None:
    store = ChunkStore(fingerprint=FP, memory_limit=5_000, disk_dir=tmp_path, disk_limit=100_000)
    kvs = [make_kv(f"k{i}", 4, seed=i) for i in range(4)]  # 2,048 bytes each: two fit
    for kv in kvs:
        store.put_canonical(kv)
    assert store.stats().memory_entries == 2
    assert_same(store.get_canonical("k0"), kvs[0])  # type: ignore[arg-type]
    stats = store.stats()
    assert (stats.disk_hits, stats.memory_entries) == (1, 2) and stats.memory_bytes <= 5_000
    assert_same(store.get_canonical("k3"), kvs[3])  # type: ignore[arg-type]
    assert store.stats().memory_hits == 1
    written = store.stats().disk_entries
    store.put_canonical(make_kv("k9", 4, seed=9))  # evicts k0, promoted: its file is still there
    assert store.stats().disk_entries == written
    assert [(e.key.key, e.detail) for e in store.events()][-1] == ("k0", "already on disk")


# --- memory-only, policies ----------------------------------------------------------------


def test_memory_only_store_counts_what_it_drops() -> None:
    store = ChunkStore(fingerprint=FP, memory_limit=4_500)
    for i in range(3):
        store.put_canonical(make_kv(f"k{i}", 4, seed=i))
    assert not store.contains(EntryKey.canonical("k0")) and store.get_canonical("k0") is None
    stats = store.stats()
    assert (stats.evictions, stats.dropped, stats.lost, stats.misses) == (1, 1, 1, 1)
    (event,) = store.events()
    assert (event.kind, event.key, event.lost, event.detail) == (
        "drop",
        EntryKey.canonical("k0"),
        True,
        "no disk tier",
    )


@pytest.mark.parametrize(
    ("policy", "victim"), [("lru", "k1"), ("fifo", "k0"), ("largest_first", "k2"), ("lfu", "k1")]
)
def test_eviction_policies_pick_their_victim(policy: str, victim: str) -> None:
    store = ChunkStore(fingerprint=FP, memory_limit=8_000, policy=policy)
    store.put_canonical(make_kv("k0", 2))  # 1,024 bytes, used again below
    store.put_canonical(make_kv("k1", 2))  # 1,024 bytes
    store.put_canonical(make_kv("k2", 4))  # 2,048 bytes
    assert store.get_canonical("k0") is not None
    store.put_canonical(make_kv("k3", 8))  # 4,096 bytes: over budget by 192, one victim leaves
    assert [event.key.key for event in store.events()] == [victim]


def test_policies_are_a_registry_of_scores_and_callables_plug_in() -> None:
    assert set(EVICTION_POLICIES) == {"lru", "fifo", "lfu", "largest_first"}
    with pytest.raises(ValueError, match=r"unknown eviction policy 'mru'.*fifo, largest_first, lfu, lru"):
        ChunkStore(fingerprint=FP, memory_limit=1_000, policy="mru")
    store = ChunkStore(fingerprint=FP, memory_limit=2_100, policy=lambda info: -info.last_used)  # MRU
    for i in range(3):
        store.put_canonical(make_kv(f"k{i}", 2))
    assert [event.key.key for event in store.events()] == ["k1"]


# --- named errors -------------------------------------------------------------------------


def test_budget_smaller_than_one_entry_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(StoreLimitError, match=r"takes 2048 bytes but memory_limit is 2000 bytes: raise"):
        ChunkStore(fingerprint=FP, memory_limit=2_000).put_canonical(make_kv("k", 4))
    store = ChunkStore(fingerprint=FP, memory_limit=10_000, disk_dir=tmp_path, disk_limit=1_000)
    with pytest.raises(StoreLimitError, match=r"takes 2048 bytes but disk_limit is 1000 bytes: raise"):
        store.put_canonical(make_kv("k", 4))
    assert store.stats().puts == 0 and store.keys() == []  # refused before anything changed
    for bad in (0, -5, 1.5, True):
        with pytest.raises(StoreLimitError, match="positive number of bytes"):
            ChunkStore(fingerprint=FP, memory_limit=bad)  # type: ignore[arg-type]
    with pytest.raises(StoreLimitError, match="disk_dir and disk_limit go together"):
        ChunkStore(fingerprint=FP, memory_limit=1_000, disk_dir=tmp_path)


def test_foreign_fingerprint_is_refused_on_put_and_on_load(tmp_path: Path) -> None:
    store = ChunkStore(fingerprint=FP, memory_limit=10_000, disk_dir=tmp_path, disk_limit=100_000)
    with pytest.raises(ForeignChunkError, match=r"one store .* per model fingerprint"):
        store.put_canonical(replace(make_kv("k", 2), model_fingerprint=OTHER_FP))
    with pytest.raises(ForeignPatchError):  # ForeignChunkError is a ForeignPatchError
        store.put_patch(replace(make_patch("k", "a", 2, 1), model_fingerprint=OTHER_FP))
    unknown = replace(make_kv("k", 2), model_fingerprint="")  # unknown: accepted and stamped
    store.put_canonical(unknown)
    stored = store.get_canonical("k")
    assert stored is not None and stored.model_fingerprint == FP
    store.put_vision("v", make_vision(2))
    store.close()  # one process-open store per directory: the other model's store opens it next
    other = ChunkStore(fingerprint=OTHER_FP, memory_limit=10_000, disk_dir=tmp_path, disk_limit=100_000)
    with pytest.raises(ForeignChunkError, match=f"made by model {FP[:16]}"):
        other.get_vision("v")
    assert other.contains(EntryKey.vision("v"))  # another model's valid file is left alone


def test_entries_without_a_content_key_are_refused() -> None:
    store = ChunkStore(fingerprint=FP, memory_limit=10_000)
    with pytest.raises(StoreKeyError, match="content key"):
        store.put_canonical(make_kv("", 2))
    with pytest.raises(StoreKeyError, match="reserved"):
        store.put_vision("v", {"__metadata__": torch.zeros(1)})
    with pytest.raises(StoreKeyError, match="fingerprint"):
        ChunkStore(fingerprint="", memory_limit=10_000)


# --- threads ------------------------------------------------------------------------------


def test_concurrent_puts_and_gets_keep_the_invariants(tmp_path: Path) -> None:
    memory_limit, disk_limit = 30_000, 80_000
    store = ChunkStore(fingerprint=FP, memory_limit=memory_limit, disk_dir=tmp_path, disk_limit=disk_limit)
    keys = KEYS[::2]
    content = {key: build(key, 0) for key in keys}  # content-addressed: one content per key
    failures: list[str] = []
    counts = {"puts": 0, "gets": 0}
    counter_lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        puts = gets = 0
        try:
            for _ in range(120):
                key = rng.choice(keys)
                if rng.random() < 0.5:
                    put(store, key, content[key])
                    puts += 1
                else:
                    got = get(store, key)
                    gets += 1
                    if got is not None:
                        assert_same(got, content[key])
                stats = store.stats()
                assert stats.memory_bytes <= memory_limit and stats.disk_bytes <= disk_limit
        except Exception as exc:  # reported below: an assert in a thread would vanish
            failures.append(repr(exc))
        with counter_lock:
            counts["puts"] += puts
            counts["gets"] += gets

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    stats = store.stats()
    assert (stats.puts, stats.hits + stats.misses) == (counts["puts"], counts["gets"])
    assert stats.memory_bytes <= memory_limit and stats.disk_bytes == file_bytes(tmp_path) <= disk_limit
    for key in store.keys():  # noqa: SIM118  (a list snapshot: gets below may evict)
        got = get(store, key)
        if got is None:  # an earlier get's promotion pushed it out of both tiers, and said so
            assert any(event.key == key and event.lost for event in store.events())
        else:
            assert_same(got, content[key])


# --- durability and one writer per directory ------------------------------------------------

_WRITER = """
import sys
import torch
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import ChunkStore
shared = sys.argv[3] == "hold"
store = ChunkStore(
    fingerprint=sys.argv[2], memory_limit=1 << 20, disk_dir=sys.argv[1], disk_limit=1 << 20,
    disk_shared=shared,
)
store.put_canonical(ChunkKV(torch.ones(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), None, "durable", sys.argv[2]))
if shared:
    print("holding", flush=True)
    sys.stdin.readline()
    assert store.get_canonical("mine") is not None  # the other process's entry, read here
"""  # no flush, no close: the entry lives only in memory until the interpreter exits


def test_a_store_written_without_flush_is_found_by_the_next_process(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _WRITER, str(tmp_path), FP, "exit"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    with ChunkStore(fingerprint=FP, memory_limit=1 << 20, disk_dir=tmp_path, disk_limit=1 << 20) as store:
        found = store.get_canonical("durable")
        assert found is not None and float(found.keys.sum()) == 24.0


def test_a_second_process_shares_one_directory_while_the_first_holds_it(tmp_path: Path) -> None:
    """Any number of processes open one ``disk_dir`` at once (shared: every put a file at once):
    each reads what the other wrote while both run, and the budget counts both's files."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), FP, "hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        with ChunkStore(
            fingerprint=FP, memory_limit=1 << 20, disk_dir=tmp_path, disk_limit=1 << 20, disk_shared=True
        ) as store:
            found = store.get_canonical("durable")  # filed by the holder, which runs on
            assert found is not None and float(found.keys.sum()) == 24.0
            store.put_canonical(make_kv("mine", 4))
            keys = store.keys()
            assert {k.key for k in keys} == {"durable", "mine"}
            assert store.stats().disk_entries == 2
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()  # type: ignore[union-attr]
    assert holder.returncode == 0


def test_stores_sharing_a_directory_keep_one_budget_and_never_serve_a_replaced_file(tmp_path: Path) -> None:
    """Two stores on one folder (each its own index connection, as two processes have): the
    budget counts both's files, the least recently used leave first whoever wrote them, and an
    entry one replaces is what the other reads from then on."""

    def store() -> ChunkStore:
        return ChunkStore(
            fingerprint=FP, memory_limit=4_000, disk_dir=tmp_path, disk_limit=8_000, disk_shared=True
        )

    a, b = store(), store()
    size = file_of(a, a.put_canonical(make_kv("a0", 4))).stat().st_size  # ~2.4 KB a file
    assert 8_000 // size == 3  # three fit
    b.put_canonical(make_kv("b0", 4))
    a.put_canonical(make_kv("a1", 4))  # (a0 leaves a's memory: one entry fits it)
    b.put_canonical(make_kv("b1", 4))  # over the budget: a0, the least recently used, leaves
    assert a.stats().disk_entries == b.stats().disk_entries == 3
    assert a.stats().disk_bytes == b.stats().disk_bytes <= 8_000
    assert not a.contains(EntryKey.canonical("a0")) and a.get_canonical("b0") is not None
    assert a.stats().disk_entries == 3  # (a read b0: promoted into its memory, still one file)
    b.put_canonical(make_kv("b1", 4, seed=9))  # b replaces b1's file: a reads the new one
    got = a.get_canonical("b1")
    assert got is not None and torch.equal(got.keys, make_kv("b1", 4, seed=9).keys)
    assert len(list(tmp_path.glob("canonical-*"))) == 3  # the replaced file deleted
    a.close()
    b.close()


def test_a_directory_that_cannot_be_used_is_a_store_error(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    with pytest.raises(StoreDirectoryError, match="not-a-dir"):
        ChunkStore(fingerprint=FP, memory_limit=1_000, disk_dir=a_file, disk_limit=1_000)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions: nothing to test here
            return
        with pytest.raises(StoreDirectoryError, match="locked"):
            ChunkStore(fingerprint=FP, memory_limit=1_000, disk_dir=locked, disk_limit=1_000)
    finally:
        locked.chmod(0o700)


def test_putting_the_same_entry_again_keeps_its_durable_file(tmp_path: Path) -> None:
    with ChunkStore(fingerprint=FP, memory_limit=10_000, disk_dir=tmp_path, disk_limit=100_000) as store:
        kv = make_kv("k", 4)
        store.put_canonical(kv)
        store.flush()
        before = sorted(p.name for p in tmp_path.glob("canonical-*"))
        store.put_canonical(make_kv("k", 4))  # the same tensors
        assert sorted(p.name for p in tmp_path.glob("canonical-*")) == before
        store.put_canonical(make_kv("k", 4, seed=99))  # other bytes under the key: the file is stale
        assert not list(tmp_path.glob("canonical-*"))


@pytest.mark.parametrize("error", [float("nan"), float("inf"), -0.5])
def test_an_audit_that_is_no_measurement_is_refused_when_read(tmp_path: Path, error: float) -> None:
    """An audit's error is a finite number >= 0; a file saying otherwise (written by hand or
    damaged in a way its checksum cannot see) is dropped when read, never served as a drift."""
    store = ChunkStore(fingerprint=FP, memory_limit=4_000, disk_dir=tmp_path, disk_limit=100_000)
    store.put_audit(DriftAudit("chunk", "state", "left", error, 3))
    store.close()
    reopened = ChunkStore(fingerprint=FP, memory_limit=4_000, disk_dir=tmp_path, disk_limit=100_000)
    assert reopened.get_audit("chunk", "state", "left") is None
    assert reopened.stats().corrupt_dropped == 1
