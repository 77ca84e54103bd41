"""Writes a shared tier takes behind its caller: a queue bounded in bytes and one writer thread.

Why: a put into a tier across the network must never wait for it (an engine's step, a window's
commit), and a queue that grows without bound would hold a process's memory hostage to a slow
server. So a shared tier (Valkey/Redis, S3) queues each entry and returns; one daemon thread
serializes and writes them in order, each by its own deadline; a put that would pass the bound
is skipped and counted (the entry stays in the tiers above); a process that never closes its
store still finishes its queue at exit.

    put ──► queue (pending bytes ≤ limit, else skipped) ──writer thread──► write(entry) ─► counted

`SharedTier` is the tier every such place is: opened from a URL its class parses, keyed by model,
called outside the store's lock, written on every put, behind the caller.

Counts (``counts``, beside what the tier counts itself through `count`): ``writes``,
``bytes_written``, ``writes_skipped``, ``writes_failed`` and ``deadline_writes`` (failed at their
deadline).
"""

from __future__ import annotations

import atexit
import logging
from abc import abstractmethod
from collections import Counter, deque
from collections.abc import Callable
from typing import ClassVar, Generic, Protocol, TypeVar

from kamera_agent.store.codec import CorruptEntry
from kamera_agent.store.deadlines import Deadlines
from kamera_agent.store.keys import EntryKey
from kamera_agent.store.tier import Entry, Lookup, Tier, TierContext, Write
from kamera_agent.threads import WorkerThread

__all__ = ["SharedTier", "WriteBehind"]

_LOG = logging.getLogger("kamera_agent.store")


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


class _Address(Protocol):
    @property
    def pending_bytes(self) -> int: ...


A = TypeVar("A", bound=_Address)
T = TypeVar("T")


class SharedTier(Tier, Generic[A]):
    """A place every process naming one URL shares (a Valkey/Redis server, an S3 bucket): keyed by
    model, every put written to it behind the caller (`WriteBehind`). Thread-safe.

    A subclass says how its URL reads (`parse_url`), how one entry is written (`_write`, on the
    writer thread) and which of its client's errors mean "did not answer" (``unanswered``, and of
    those ``cut``: at the deadline).

    Args:
        address: where the place is, as `parse_url` read it (its ``pending_bytes`` bound the queue).
        fingerprint: the model every entry carries (its keys name it).
        deadlines: how long each lookup and write may take in all.
    """

    name = "shared"  # each subclass names its own ("remote", "s3")
    locked = False
    keyed_by_model = True
    written_on_put = True
    unanswered: ClassVar[type[Exception]]
    cut: ClassVar[type[Exception]]

    def __init__(self, address: A, fingerprint: str, deadlines: Deadlines | None = None) -> None:
        self.address = address
        self.location = str(address)
        self.deadlines = deadlines or Deadlines()
        self._fingerprint = fingerprint
        self._writes = WriteBehind(
            self._write,
            limit=address.pending_bytes,
            unavailable=self.unanswered,
            deadline=self.cut,
            name=f"kamera-{self.name}-writer",
            log=_LOG,
        )
        self.counts = self._writes.counts
        """What the writer did (`WriteBehind`), and what the tier counts itself (`_count`)."""

    @classmethod
    @abstractmethod
    def parse_url(cls, url: str) -> A:
        """The address ``url`` names (`kamera_agent.errors.StoreURLError` when it names none)."""

    @classmethod
    def check_url(cls, url: str) -> None:
        """Refuse a URL `parse_url` refuses, connecting to nothing."""
        cls.parse_url(url)

    @classmethod
    def from_url(cls, url: str, context: TierContext) -> SharedTier[A]:
        """The tier of the place ``url`` names, under ``context``'s model and deadlines."""
        return cls(cls.parse_url(url), context.fingerprint, context.deadlines)

    def put(self, entry: Entry) -> Write:
        """Queue the entry (serialized on the writer thread); not ``ok`` when the queue is full or
        the tier closed (skipped and counted: the entry stays local)."""
        return self._writes.put(entry)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write is done (or failed), at most ``timeout`` seconds."""
        self._writes.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Drain the queue (within ``timeout``), stop the writer, let the connection go."""
        self._writes.close(timeout)
        self._disconnect()

    @abstractmethod
    def _write(self, entry: Entry) -> int:
        """Write one entry by the deadline its tokens give (on the writer thread); the bytes sent."""

    def _disconnect(self) -> None:
        """Let go of the client (after the last write)."""

    def _count(self, name: str, n: int = 1) -> None:
        self._writes.count(name, n)

    def _lookup(self, key: EntryKey, look: Callable[[], Lookup[T]]) -> Lookup[T]:
        """``look()``'s answer, where the place not answering is `Status.UNAVAILABLE` and an entry
        that failed a check is deleted and `Status.REJECTED` (never served)."""
        try:
            return look()
        except self.unanswered as exc:
            return Lookup.unavailable(str(exc))
        except CorruptEntry as exc:
            self.reject(key, exc)
            return Lookup.rejected(str(exc))
