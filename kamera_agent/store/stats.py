"""What the store did: a typed stats snapshot and a bounded log of the events that cost an entry.

Why: the window's invariant 4 ("when the limit pushes a canonical out, recall re-forms and
stats says so") needs every miss to be explainable. Each spill, drop, disk eviction and
corrupt or outdated file is an event naming the entry and whether it is now *lost* (held by no tier); the
counters in `StoreStats` are tallies of the same events, so the two can never disagree.
"""

from __future__ import annotations

import warnings
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Literal

from kamera_agent.store.instrumented import TierStats
from kamera_agent.store.keys import EntryKey

__all__ = ["EventKind", "EventLog", "StoreEvent", "StoreStats"]

EventKind = Literal["spill", "drop", "disk_evict", "corrupt", "outdated"]


@dataclass(frozen=True)
class StoreEvent:
    """One entry leaving a tier.

    Attributes:
        kind: ``"spill"`` (memory → disk), ``"drop"`` (left memory with nowhere to go),
            ``"disk_evict"`` (file removed for the disk limit), ``"corrupt"`` (file failed its
            checksum or did not deserialize and was deleted; never served), ``"outdated"`` (file written in
            another entry format, by an older kamera-agent: deleted, never deserialized; ``detail``
            names both formats).
        key: the entry's address.
        nbytes: the entry's tensor bytes (memory events) or its file size (disk events).
        lost: no tier holds the entry any more: the next get misses and the caller forms it again.
        detail: why, in words (for logs).
    """

    kind: EventKind
    key: EntryKey
    nbytes: int
    lost: bool
    detail: str = ""


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the store's counters and occupancy (``store.stats()``).

    Attributes:
        puts: entries stored by the caller.
        hits: gets served by any tier (``memory_hits + disk_hits + remote_hits``, plus those of
            tiers passed as ``ChunkStore(tiers=...)``).
        memory_hits: gets served from memory.
        disk_hits: gets served from a verified disk file (and promoted when it fits).
        misses: gets that found nothing servable.
        memory_bytes: tensor bytes held in memory (never above ``memory_limit``).
        memory_limit: the memory tier's byte limit.
        memory_entries: entries held in memory.
        disk_bytes: file bytes on disk (never above ``disk_limit``); 0 without a disk tier.
        disk_limit: the disk tier's byte limit; 0 without a disk tier.
        disk_entries: files on disk.
        evictions: entries pushed out of memory (``spills + dropped``).
        spills: memory evictions that kept the entry on disk.
        dropped: memory evictions with no disk copy (no disk tier, or too large for it).
        disk_evictions: files removed for the disk limit.
        corrupt_dropped: files that failed their checksum or did not deserialize, deleted, never served.
        outdated_dropped: files of another entry format (an older kamera-agent's), deleted
            unread; their entries are recomputed.
        lost: entries no tier holds any more, over all the causes above.
        unavailable: lookups (gets, ``has_*``, peeks) that a tier did not answer (a server
            down or timing out), over every tier: never taken as the entry's absence.
        remote_state: the shared tier: ``"off"`` (none), ``"up"``, ``"down"`` (working
            locally, retrying with backoff) or ``"slow"`` (up, but its calls outlived their
            deadlines: skipped for a while, then asked again).
        remote_hits: gets served from the shared tier (verified, then promoted to memory).
        remote_misses: shared-tier gets that found no entry (``remote_errors`` of them because
            the server did not answer).
        remote_errors: shared-tier gets that failed or were skipped while it was down.
        remote_writes: entries written to the shared tier; ``remote_bytes_written`` their bytes.
        remote_writes_skipped: writes not queued (the background queue's byte bound was full).
        remote_writes_failed: queued writes the server did not take (the entry stays local).
        remote_rejected: shared values that failed a check (digest, length, address, model,
            entry format): deleted, never served.
        remote_outages: times the server went from answering to not answering.
        remote_timeout: the shared tier's current per-call timeout, seconds (it grows while a
            healthy server answers slowly, up to the URL's ``max_timeout``, and decays back).
        remote_slow_calls: calls that timed out on an answering server and raised the timeout
            instead of counting an outage.
        remote_deadline_misses: shared-tier lookups abandoned at their total deadline (what
            recomputing the entry costs, `kamera_agent.store.deadlines`): each a miss, among
            ``remote_errors`` (gets) and ``unavailable``; the entry is computed locally.
        remote_deadline_writes: shared-tier writes abandoned at their deadline (among
            ``remote_writes_failed``; the entry stays local).
        unsigned_refused: entries a tier held that were unsigned or whose MAC did not verify
            under the store's secret (forged, or written without it): never served, left in
            place (another deployment's secret may sign them); 0 without a secret.
        tiers: every tier below memory by name (``"disk"``, ``"remote"``, ``"s3"``, a second
            one of a kind ``"remote_2"``): what it was asked and answered, its bytes, seconds and
            errors (`TierStats`, counted by `kamera_agent.store.instrumented.InstrumentedTier`).
            The ``remote_*`` fields above are the first Valkey/Redis tier's, kept by name.
    """

    puts: int
    hits: int
    memory_hits: int
    disk_hits: int
    misses: int
    memory_bytes: int
    memory_limit: int
    memory_entries: int
    disk_bytes: int
    disk_limit: int
    disk_entries: int
    evictions: int
    spills: int
    dropped: int
    disk_evictions: int
    corrupt_dropped: int
    lost: int
    outdated_dropped: int = 0
    unavailable: int = 0
    remote_state: str = "off"
    remote_hits: int = 0
    remote_misses: int = 0
    remote_errors: int = 0
    remote_writes: int = 0
    remote_bytes_written: int = 0
    remote_writes_skipped: int = 0
    remote_writes_failed: int = 0
    remote_rejected: int = 0
    remote_outages: int = 0
    remote_timeout: float = 0.0
    remote_slow_calls: int = 0
    remote_deadline_misses: int = 0
    remote_deadline_writes: int = 0
    unsigned_refused: int = 0
    tiers: dict[str, TierStats] = field(default_factory=dict)

    @property
    def memory_budget(self) -> int:
        """The old name of `memory_limit` (deprecated)."""
        warnings.warn("StoreStats.memory_budget is now memory_limit", DeprecationWarning, stacklevel=2)
        return self.memory_limit

    @property
    def disk_budget(self) -> int:
        """The old name of `disk_limit` (deprecated)."""
        warnings.warn("StoreStats.disk_budget is now disk_limit", DeprecationWarning, stacklevel=2)
        return self.disk_limit


class EventLog:
    """Counters of every event plus the most recent events themselves (bounded, oldest dropped).

    Not thread-safe on its own: the store calls it under its lock.
    """

    def __init__(self, capacity: int) -> None:
        self.counts: Counter[str] = Counter()
        self._events: deque[StoreEvent] = deque(maxlen=capacity)

    def record(self, event: StoreEvent) -> None:
        self.counts[event.kind] += 1
        self.counts["lost"] += int(event.lost)
        self._events.append(event)

    def count(self, name: str, times: int = 1) -> None:
        """Tally a non-event counter (puts, hits, misses)."""
        self.counts[name] += times

    def recent(self) -> list[StoreEvent]:
        return list(self._events)

    def drain(self) -> list[StoreEvent]:
        events = list(self._events)
        self._events.clear()
        return events
