"""Writes a shared tier takes behind its caller: a queue bounded in bytes and one writer thread.

Why: a put into a tier across the network must never wait for it (an engine's step, a window's
commit), and a queue that grows without bound would hold a process's memory hostage to a slow
server. So a shared tier (Valkey/Redis, S3) queues each entry and returns; one daemon thread
serializes and writes them in order, each by its own deadline; a put that would pass the bound
is skipped and counted (the entry stays in the tiers above); a process that never closes its
store still finishes its queue at exit.

    put ──► queue (pending bytes ≤ limit, else skipped) ──writer thread──► write(entry) ─► counted

Counts (``counts``, beside what the tier counts itself through `count`): ``writes``,
``bytes_written``, ``writes_skipped``, ``writes_failed`` and ``deadline_writes`` (failed at their
deadline).
"""

from __future__ import annotations

import atexit
import logging
from collections import Counter, deque
from collections.abc import Callable

from kamera_agent.store.tier import Entry, Write
from kamera_agent.threads import WorkerThread

__all__ = ["WriteBehind"]


class WriteBehind:
    """One tier's queued writes. Thread-safe.

    Args:
        write: writes one entry, returning the bytes it sent; called on the writer thread only.
        limit: the most bytes queued or being written at once.
        unavailable: what ``write`` raises when the place did not answer (a failed write, counted).
        deadline: the kind of ``unavailable`` that says the write was cut at its deadline.
        name: the writer thread's name.
        log: where a write that raised something else (a bug) is logged.
    """

    def __init__(
        self,
        write: Callable[[Entry], int],
        *,
        limit: int,
        unavailable: type[Exception],
        deadline: type[Exception],
        name: str,
        log: logging.Logger,
    ) -> None:
        self.counts: Counter[str] = Counter()
        self._worker = WorkerThread(name, self._loop)  # busy: bytes queued or being written
        self.lock = self._worker.lock
        """Guards ``counts``, the queue and the pending bytes (a tier may count under it too)."""
        self._write, self._limit, self._log = write, limit, log
        self._unavailable, self._deadline = unavailable, deadline
        self._queue: deque[Entry] = deque()
        with self.lock:
            self._worker.start_once()
        atexit.register(self._finish_at_exit)

    @property
    def pending(self) -> int:
        """Bytes queued or being written."""
        with self.lock:
            return self._worker.busy

    def put(self, entry: Entry) -> Write:
        """Queue ``entry``; not ``ok`` when the queue is full or closed (skipped and counted)."""
        with self.lock:
            if self._worker.closed or self._worker.busy + entry.nbytes > self._limit:
                self.counts["writes_skipped"] += 1
                return Write(False, "closed" if self._worker.closed else "the write queue is full")
            self._queue.append(entry)
            self._worker.busy += entry.nbytes
            self.lock.notify_all()
        return Write.done()

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write is done (or failed), at most ``timeout`` seconds."""
        self._worker.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Drain the queue (within ``timeout``) and stop the writer. Idempotent."""
        atexit.unregister(self._finish_at_exit)
        self._worker.close(timeout)

    def _finish_at_exit(self) -> None:
        self.flush(timeout=5.0)

    def _loop(self) -> None:
        for entry in self._worker.items(self._queue):
            try:
                written = self._write(entry)
                self.count("writes")
                self.count("bytes_written", written)
            except self._unavailable as exc:
                self.count("writes_failed")
                self.count("deadline_writes", int(isinstance(exc, self._deadline)))
            except Exception:  # a bug must not kill the writer; the entry stays local
                self._log.exception("writing %s to a shared tier failed", entry.key)
                self.count("writes_failed")
            finally:
                with self.lock:
                    self._worker.busy -= entry.nbytes
                    self.lock.notify_all()
