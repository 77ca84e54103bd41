"""Every call to an object store by a deadline, and none while it stays away.

Why: a boto3 call blocks its thread for as long as the HTTP client waits, and a lookup must
never wait longer than recomputing its entry costs (`kamera_agent.store.deadlines`). So each
call runs on a small pool and the caller waits for it only until its deadline: past that it is
abandoned (the pool's thread finishes within the client's own timeout) and the answer is
"unavailable". A store that failed to answer is then skipped for ``backoff`` seconds (doubling
while it stays away, up to `MAX_BACKOFF`): a lost server costs each lookup nothing, not a
timeout each.

    call(work, until) ──► skipped while down ─────────────────────────────► S3Unavailable
                      └─► pool ──► answered by until ──► result (up again)
                                └─ raised, or not by until ──► down for backoff ─► S3Unavailable
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["MAX_BACKOFF", "Calls", "DeadlineMissed", "S3Unavailable"]

T = TypeVar("T")
MAX_BACKOFF = 30.0
"""The longest an unanswering store is skipped before it is asked again (seconds)."""


class S3Unavailable(Exception):
    """The object store did not answer (down, refused, past the deadline, or skipped)."""


class DeadlineMissed(S3Unavailable):
    """The call did not finish by its deadline (it was abandoned, the store skipped a while)."""


class Calls:
    """Calls to one object store, each by its deadline. Thread-safe.

    Args:
        backoff: seconds the store is skipped after it first fails to answer.
        workers: calls in flight at once (abandoned ones hold theirs until the client gives up).
    """

    def __init__(self, backoff: float, workers: int = 4) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kamera-s3")
        self._first_backoff = backoff
        self._backoff = backoff
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.outages = 0
        """Times the store went from answering to not answering."""

    @property
    def down(self) -> bool:
        """The store failed to answer lately and is being skipped."""
        with self._lock:
            return time.monotonic() < self._down_until

    def call(self, work: Callable[[], T], until: float) -> T:
        """``work()``'s result if it comes by ``until`` (a `time.monotonic` instant); ``work``
        answers an absent object itself (``None``), so whatever it raises is a failure.

        Raises:
            S3Unavailable: skipped (down), failed, or not answered by ``until``.
        """
        if self.down:
            raise S3Unavailable("skipped: the object store did not answer lately")
        try:
            future = self._pool.submit(work)
        except RuntimeError as exc:  # the pool was shut down: the tier is closed
            raise S3Unavailable("closed") from exc
        try:
            result = future.result(timeout=max(0.0, until - time.monotonic()))
        except concurrent.futures.TimeoutError:
            future.cancel()
            self._failed()
            raise DeadlineMissed("no answer by the deadline") from None
        except Exception as exc:
            self._failed()
            raise S3Unavailable(f"{type(exc).__name__}: {exc}") from exc
        self._answered()
        return result

    def close(self) -> None:
        """Stop taking calls; those in flight finish on their own (within the client's timeout)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _failed(self) -> None:
        with self._lock:
            now = time.monotonic()
            if now >= self._down_until and self._backoff == self._first_backoff:
                self.outages += 1
            self._down_until = now + self._backoff
            self._backoff = min(MAX_BACKOFF, self._backoff * 2)

    def _answered(self) -> None:
        with self._lock:
            self._backoff = self._first_backoff
