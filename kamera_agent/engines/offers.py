"""Entries whose load failed: not offered again until the store has them afresh.

Why: an engine offers what its store says it holds, and the load runs later (vLLM's worker, off
the step; SGLang's admission). An entry can leave the store in between (evicted, expired), or
be held but unreadable (damaged, unsigned under a secret, too slow for its deadline: the store
says "present" while every read fails). Offered again, such an entry fails again: vLLM then
re-offers the same tokens every step until the request gives up, or forever. So a
failed load blocks its entry here: the planner skips it (the engine computes those tokens at
once, and its capture files the entry anew), until the store has it afresh:

    failure 1 ──► blocked until a capture re-files it (or `RETRY_AFTER` seconds pass: another
                  process may have filed it, which this one cannot see); loads of it that fail
                  before then (other requests offered it in the same step) are the same failure
    failure 2+ ─► blocked for RETRY_AFTER × 2^(n-2) seconds, re-filed or not (a store whose
                  reads of it keep failing: at most one more offer each time)
    a load of it written ──► forgotten

So a lost entry costs at most two offers (the one that failed, and one after it was filed
anew that fails only if the store loses it again), and an unreadable one the same per period.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kamera_agent.store import EntryKey

__all__ = ["RETRY_AFTER", "FailedEntries"]

RETRY_AFTER = 60.0
"""Seconds an entry whose load failed once stays blocked when nothing files it anew."""
_REMEMBERED = 1 << 16


@dataclass
class _Failure:
    count: int
    at: float
    refiled: bool = False


class FailedEntries:
    """The entries an engine side saw fail to load, and whether each was filed anew since.
    Thread-safe (a worker's reports and the planner may run on different threads).

    Args:
        retry_after: seconds a first failure blocks an entry nothing files anew.
        clock: the time source (``time.monotonic``; a test passes its own).
    """

    def __init__(self, retry_after: float = RETRY_AFTER, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_after, self._clock = retry_after, clock
        self._failures: OrderedDict[EntryKey, _Failure] = OrderedDict()
        self._lock = threading.Lock()

    def failed(self, entries: Iterable[EntryKey]) -> None:
        """A load of each of ``entries`` failed (gone, or unreadable). Loads that failed before
        it was filed anew (requests offered it in one step) are one failure."""
        now = self._clock()
        with self._lock:
            for entry in entries:
                known = self._failures.pop(entry, None)
                if known is not None and not known.refiled:
                    self._failures[entry] = known
                    continue
                self._failures[entry] = _Failure(1 if known is None else known.count + 1, now)
            while len(self._failures) > _REMEMBERED:  # bounded: the oldest go first
                self._failures.popitem(last=False)

    def refiled(self, entries: Iterable[EntryKey]) -> None:
        """Each of ``entries`` was filed again (a capture of the tokens the engine computed)."""
        with self._lock:
            for entry in entries:
                known = self._failures.get(entry)
                if known is not None:
                    known.refiled = True

    def loaded(self, entries: Iterable[EntryKey]) -> None:
        """A load of each of ``entries`` was written: they are fine again."""
        with self._lock:
            for entry in entries:
                self._failures.pop(entry, None)

    def blocked(self, entry: EntryKey) -> bool:
        """Whether ``entry`` must not be offered now."""
        if not self._failures:  # (no lock: what nearly every lookup of a healthy store asks)
            return False
        with self._lock:
            known = self._failures.get(entry)
            if known is None:
                return False
            if self._clock() >= known.at + self.retry_after * 2 ** max(0, known.count - 2):
                del self._failures[entry]
                return False
            return not (known.refiled and known.count == 1)

    def __len__(self) -> int:
        return len(self._failures)
