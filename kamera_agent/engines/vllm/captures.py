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

`flush` waits until every queued capture is filed (tests read the store after the engine's last
step; a connector's `shutdown` and the process's exit flush too).
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kamera_agent.engines.faults import HookFaults
from kamera_agent.store import EntryKey

__all__ = ["CaptureWriter", "Copied", "copy_out"]


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
    """

    entry: EntryKey
    start: int
    end: int
    blocks: tuple[torch.Tensor, ...]
    rows: torch.Tensor
    ready: Any = None

    @property
    def nbytes(self) -> int:
        return sum(block.numel() * block.element_size() for block in self.blocks)

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
    """

    def __init__(
        self, file: Callable[[Copied], None], faults: HookFaults, max_bytes: int = 256 << 20
    ) -> None:
        self._file, self._faults, self.max_bytes = file, faults, max_bytes
        self._queue: deque[Copied] = deque()
        self._pending = 0  # bytes queued or being filed
        self._busy = 0  # captures queued or being filed
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dropped = 0
        """Captures dropped because the queue was full (or the writer closed)."""
        self.filed = 0
        """Captures filed."""

    def submit(self, copied: Copied) -> bool:
        """Queue ``copied``; ``False`` (dropped, counted) when the queue is full. Never waits."""
        with self._lock:
            if self._closed or (self._busy and self._pending + copied.nbytes > self.max_bytes):
                self.dropped += 1
                return False
            self._queue.append(copied)
            self._pending += copied.nbytes
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kamera-vllm-captures", daemon=True)
                self._thread.start()
                atexit.register(self.flush, 10.0)  # a process that never shuts the connector down
            self._lock.notify_all()
        return True

    @property
    def pending(self) -> int:
        """Captures queued or being filed."""
        with self._lock:
            return self._busy

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued capture is filed (at most ``timeout`` seconds); whether it was."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """File what is queued (within ``timeout``), then stop the thread; later captures drop."""
        self.flush(timeout)
        with self._lock:
            self._closed = True
            thread = self._thread
            self._lock.notify_all()
        if thread is not None:
            atexit.unregister(self.flush)
            thread.join(timeout=1.0)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                copied = self._queue.popleft()
            try:
                copied.wait()
                self._file(copied)
                filed = 1
            except Exception as exc:  # a capture missed costs a later forward; the thread goes on
                self._faults.caught("capture_writer", exc)
                filed = 0
            with self._lock:
                self.filed += filed
                self._pending -= copied.nbytes
                self._busy -= 1
                self._lock.notify_all()
