"""The memory tier: live entries within a byte limit, victims chosen by an eviction policy.

Why: the tier only holds entries and their use ticks; what happens to a victim (spill to
disk, or drop) is the `ChunkStore`'s decision, so this class stays a dozen lines of
bookkeeping and the policy stays a pure score. It holds live values, already verified and
stamped, so a hit needs no deserializing; a `Tier` like the others for get, put, contains and peek.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kamera_agent.store.codec import StoredValue, header_info
from kamera_agent.store.keys import EntryKey
from kamera_agent.store.limits import EvictionPolicy, pick_victim
from kamera_agent.store.tier import Entry, Lookup, Meta, Payload, Status, Tier, Write

__all__ = ["MemoryTier", "Resident"]


@dataclass
class Resident:
    """One entry held in memory (fields double as the `EntryInfo` a policy scores)."""

    value: StoredValue
    nbytes: int
    inserted: int
    last_used: int
    hits: int = 0


class MemoryTier(Tier):
    """Entries by address with their tensor bytes; not thread-safe on its own (``locked``)."""

    name = "memory"

    def __init__(self, limit: int, policy: EvictionPolicy) -> None:
        self.limit: int = limit
        self._policy = policy
        self._entries: dict[EntryKey, Resident] = {}
        self._bytes = 0
        self._clock = itertools.count()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: EntryKey) -> bool:
        return key in self._entries

    def keys(self) -> list[EntryKey]:
        return list(self._entries)

    def get(self, key: EntryKey) -> Lookup[Payload]:
        resident = self._entries.get(key)
        if resident is None:
            return Lookup.miss()
        resident.hits += 1
        resident.last_used = next(self._clock)
        return Lookup.hit(resident.value)

    def put(self, entry: Entry) -> Write:
        """Hold the entry; the caller then evicts to the limit (`victim`, `pop`)."""
        self.add(entry.key, entry.value, entry.nbytes)
        return Write.done()

    def contains(self, key: EntryKey) -> Status:
        return Status.HIT if key in self._entries else Status.MISS

    def drop(self, key: EntryKey) -> None:
        self.pop(key)

    def peek(self, key: EntryKey) -> Lookup[Meta]:
        resident = self._entries.get(key)
        return Lookup.miss() if resident is None else Lookup.hit(header_info(key.kind, resident.value))

    def value_of(self, key: EntryKey) -> StoredValue | None:
        """The value without counting a use (the store checks for a put made meanwhile)."""
        resident = self._entries.get(key)
        return None if resident is None else resident.value

    def add(self, key: EntryKey, value: StoredValue, nbytes: int) -> None:
        """Hold ``value`` (replacing any entry at ``key``); the caller then evicts to the limit."""
        self.pop(key)
        tick = next(self._clock)
        self._entries[key] = Resident(value, nbytes, tick, tick)
        self._bytes += nbytes

    def pop(self, key: EntryKey) -> Resident | None:
        resident = self._entries.pop(key, None)
        if resident is not None:
            self._bytes -= resident.nbytes
        return resident

    def victim(self, pinned: EntryKey) -> EntryKey | None:
        """The entry to evict next while over its limit, never ``pinned`` (the one just added)."""
        if self._bytes <= self.limit:
            return None
        return pick_victim(self._entries, self._policy, pinned=pinned)

    def residents(self) -> list[tuple[EntryKey, Resident]]:
        """Entries from least to most recently used."""
        return sorted(self._entries.items(), key=lambda item: item[1].last_used)
