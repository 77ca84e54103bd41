"""Captures off vLLM's step: the KV copied out on the step, filed into the store by a thread.

Why: `wait_for_save` runs inside vLLM's engine step, after the forward, once per step. Filing a
chunk there (to float32, un-rotating its keys, serializing, the store's put) makes every step
that captures wait for kamera, and reading the cache to the CPU there is a device sync. So the
step only copies the blocks that hold the captured slots, whole, out of vLLM's caches, in the
cache's own dtype (`VLLMSlots.copy_blocks`: one contiguous copy per layer; on CUDA then a
non-blocking copy into pinned memory, ordered on the stream after the forward that wrote them),
and hands the copies to one background thread through a queue bounded in bytes; the thread picks
the chunk's tokens out of them (`VLLMSlots.unpack`: CPU attention keeps keys transposed, so that
read strides through every head, 5× the block copy on the 1.5B shape). A full queue drops the
capture and counts it (`CaptureWriter.dropped`): the step never waits for the store. A dropped
or failed capture costs a later forward, no more.

    wait_for_save ──copy blocks (cache dtype)──► queue (≤ max_bytes) ──thread──► tokens picked out,
                                   └ full: dropped, counted                     float32, position-free,
                                                                                the store's put

What is filed is what the synchronous path filed: float32 position-free keys and values, made by
the same functions from the same cache contents, so an entry decodes to the same KV bit for bit.
(The cache's own dtype cannot hold the un-rotated keys of a bf16 cache without a second rounding,
so entries stay float32; only the conversion moved off the step.)

On vLLM's CPU build even the block copy is a real memory copy on the step, growing with the
prompt (`benchmarks/vllm_step_time.py` measures it), so there the step copies nothing: it
queues the blocks to copy (`Copied.copy`) and the writer copies them on its thread.
That is safe only while vLLM keeps those blocks, and vLLM keeps a request's blocks until it ends
or is preempted: so a request with a capture queued is held past its end (the scheduler side's
``request_finished`` answers "free later") until its blocks are copied (`HeldBlocks`, reported
in ``get_finished`` as vLLM's finished sends), and a preempted request's queued copies are made
on the step before its blocks are reused (``handle_preemptions``, `CaptureWriter.copy_now`).

`flush` waits until every queued capture is filed (tests read the store after the engine's last
step; a connector's `shutdown` and the process's exit flush too).
"""

from __future__ import annotations

import atexit
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from kamera_agent.engines.faults import HookFaults
from kamera_agent.store import EntryKey
from kamera_agent.threads import WorkerThread

__all__ = ["CaptureWriter", "Copied", "HeldBlocks", "copy_out"]


@dataclass(frozen=True)
class Copied:
    """One chunk's KV as vLLM's blocks held it, copied out on the step.

    Attributes:
        entry: the entry the chunk's state belongs in.
        start, end: the request tokens it covers (its keys are rotated to those positions).
        blocks: per layer, the blocks holding its tokens, whole, in the cache's dtype, on the CPU
            (pinned where the cache is on CUDA: the copy may still be in flight until ``ready``).
        rows: its tokens' rows of those copies (`VLLMSlots.unpack`).
        ready: a CUDA event recorded after the copy (``None`` on the CPU: already done).
        copy: set where the blocks are not copied yet (``blocks`` empty): makes the copies; run
            by the writer while vLLM holds the request's blocks (`HeldBlocks`).
        size: the bytes ``copy`` will take (the queue's bound counts them from the start).
        req_id: the request whose blocks ``copy`` reads.
        positions: the tokens' M-RoPE positions ``[3, end - start]``; ``None``: their indices.
    """

    entry: EntryKey
    start: int
    end: int
    blocks: tuple[torch.Tensor, ...]
    rows: torch.Tensor
    ready: Any = None
    copy: Callable[[], tuple[torch.Tensor, ...]] | None = None
    size: int = 0
    req_id: str = ""
    positions: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        if self.copy is not None:
            return self.size
        return sum(block.numel() * block.element_size() for block in self.blocks)

    def copied(self) -> Copied:
        """This capture with its blocks copied (itself where they are)."""
        if self.copy is None:
            return self
        return replace(self, blocks=self.copy(), copy=None)

    def wait(self) -> None:
        """Block until the copy has landed (a no-op on the CPU)."""
        if self.ready is not None:
            self.ready.synchronize()


def copy_out(blocks: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Host copies of ``blocks`` (copied from the cache on its device) without a device sync: on
    CUDA a non-blocking copy into pinned memory and an event recorded after it on the current
    stream (the one the forward wrote the cache on, so the copy reads what it wrote); elsewhere
    the tensors themselves (they are copies already)."""
    if not blocks or blocks[0].device.type != "cuda":
        return tuple(block.cpu() for block in blocks), None
    hosts = []
    for block in blocks:
        host = torch.empty(block.shape, dtype=block.dtype, pin_memory=True)
        host.copy_(block, non_blocking=True)
        hosts.append(host)
    event = torch.cuda.Event()
    event.record()
    return tuple(hosts), event


class CaptureWriter:
    """A queue of copied captures, bounded in bytes, and the daemon thread that files them.

    Thread-safe. The thread starts with the first capture (a scheduler-side connector never
    starts one).

    Args:
        file: files one capture (called on the thread; what it raises is caught and counted).
        faults: where a capture that failed on the thread is counted (hook ``capture_writer``).
        max_bytes: copies queued at once; a capture beyond it is dropped.
        copied: called with a capture's ``req_id`` once its deferred copy was made or failed.
    """

    def __init__(
        self,
        file: Callable[[Copied], None],
        faults: HookFaults,
        max_bytes: int = 256 << 20,
        copied: Callable[[str], None] | None = None,
    ) -> None:
        self._file, self._faults, self.max_bytes = file, faults, max_bytes
        self._copied = copied or (lambda req_id: None)
        self._copying: Copied | None = None  # a deferred copy being made on the thread
        self._queue: deque[Copied] = deque()
        self._pending = 0  # bytes queued or being filed
        self._worker = WorkerThread("kamera-vllm-captures", self._run)  # busy: captures queued or being filed
        self._lock = self._worker.lock
        self.dropped = 0
        """Captures dropped because the queue was full (or the writer closed)."""
        self.filed = 0
        """Captures filed."""

    def submit(self, copied: Copied) -> bool:
        """Queue ``copied``; ``False`` (dropped, counted) when the queue is full. Never waits."""
        with self._lock:
            if self._worker.closed or (self._worker.busy and self._pending + copied.nbytes > self.max_bytes):
                self.dropped += 1
                return False
            self._queue.append(copied)
            self._pending += copied.nbytes
            self._worker.busy += 1
            if self._worker.start_once():
                atexit.register(self.flush, 10.0)  # a process that never shuts the connector down
            self._lock.notify_all()
        return True

    @property
    def pending(self) -> int:
        """Captures queued or being filed."""
        with self._lock:
            return self._worker.busy

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued capture is filed (at most ``timeout`` seconds); whether it was."""
        return self._worker.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """File what is queued (within ``timeout``), then stop the thread; later captures drop."""
        if self._worker.close(timeout):
            atexit.unregister(self.flush)

    def copy_now(self, req_ids: Iterable[str]) -> None:
        """Make the queued deferred copies of ``req_ids`` on the calling thread, and wait out one
        the writer is making: vLLM is about to reuse those requests' blocks (a preemption)."""
        wanted = set(req_ids)
        with self._lock:
            mine = [c for c in self._queue if c.copy is not None and c.req_id in wanted]
            for item in mine:
                self._queue.remove(item)
            while self._copying is not None and self._copying.req_id in wanted:
                self._lock.wait()
        made: list[Copied] = []
        for item in mine:
            try:
                made.append(item.copied())
            except Exception as exc:  # this capture is lost: a later forward pays, no more
                self._faults.caught("handle_preemptions", exc)
                with self._lock:
                    self._pending -= item.nbytes
                    self._worker.busy -= 1
                    self._lock.notify_all()
            finally:
                self._copied(item.req_id)
        with self._lock:
            for item in reversed(made):  # filed next, in their order
                self._queue.appendleft(item)
            self._lock.notify_all()

    def _taken(self, copied: Copied) -> None:
        if copied.copy is not None:  # a deferred copy, made on the thread from now
            self._copying = copied

    def _run(self) -> None:
        for copied in self._worker.items(self._queue, self._taken):
            try:
                if copied.copy is not None:
                    try:
                        copied = copied.copied()
                    finally:
                        self._copied(copied.req_id)
                        with self._lock:
                            self._copying = None
                            self._lock.notify_all()
                copied.wait()
                self._file(copied)
                filed = 1
            except Exception as exc:  # a capture missed costs a later forward; the thread goes on
                self._faults.caught("capture_writer", exc)
                filed = 0
            with self._lock:
                self.filed += filed
                self._pending -= copied.nbytes
                self._worker.busy -= 1
                self._lock.notify_all()


class HeldBlocks:
    """The worker side's record of requests whose blocks vLLM keeps past their end until the
    captures queued from them are copied (thread-safe: the step's hooks and the writer).

    A request is held from the step that queues its first capture (every capture the scheduler
    side planned for it) and released, through ``get_finished``, once vLLM said it ended and no
    copy of its blocks is still queued. Copies made are reported to the scheduler side with each
    step (`take_copies`): a request whose every copy was reported before it ended is freed at
    once there (``request_finished`` answers "free now") and forgotten here (`forget`); the
    others the scheduler side answers "free later", and they are released here.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uncopied: Counter[str] = Counter()
        self._made: Counter[str] = Counter()  # copies made since `take_copies`
        self._held: set[str] = set()
        self._ended: set[str] = set()

    def hold(self, req_ids: Iterable[str]) -> None:
        with self._lock:
            self._held.update(req_ids)

    def queued(self, req_id: str) -> None:
        with self._lock:
            self._uncopied[req_id] += 1

    def copied(self, req_id: str) -> None:
        """One copy of ``req_id``'s blocks made, failed or given up: its blocks are not read again."""
        with self._lock:
            self._uncopied[req_id] -= 1
            if self._uncopied[req_id] <= 0:
                del self._uncopied[req_id]
            self._made[req_id] += 1

    def take_copies(self) -> dict[str, int]:
        """Per request, the copies made since the last call (the scheduler side's count)."""
        with self._lock:
            made, self._made = dict(self._made), Counter()
            return made

    def forget(self, req_ids: Iterable[str]) -> None:
        """Requests vLLM freed at their end (every copy reported made): never released here."""
        with self._lock:
            for req_id in req_ids:
                self._held.discard(req_id)
                self._ended.discard(req_id)

    def released(self, ended: Iterable[str]) -> set[str]:
        """The held requests vLLM may free now: ended (now or before) and nothing left to copy."""
        with self._lock:
            self._ended.update(r for r in ended if r in self._held)
            free = {r for r in self._ended if not self._uncopied.get(r)}
            self._ended -= free
            self._held -= free
            return free

    @property
    def held(self) -> int:
        """Requests held now."""
        with self._lock:
            return len(self._held)
