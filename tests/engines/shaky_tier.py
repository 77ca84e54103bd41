"""A store tier that loses or spoils entries between an engine's offer and its load.

The engines plan from presence (``contains``) and load later; what happens in between is what
these tests need: a **lost** entry is present when asked and gone when read (evicted meanwhile),
an **unreadable** one is present whenever asked and every read of it fails (held, but damaged,
refused or too slow: the store answers "present" and never serves it). A `Tier`, the store's
own seam for such doubles (tests/store/test_tiers.py), behind a real `ChunkStore`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kamera_agent.store import EntryKey
from kamera_agent.store.tier import Entry, Lookup, Meta, Payload, Status, Tier, Write

__all__ = ["ShakyTier"]


class ShakyTier(Tier):
    """Entries filed elsewhere that this tier claims to hold: ``lost`` ones until first read,
    ``unreadable`` ones for good. Counts the reads of each (``reads``)."""

    name = "shaky"
    locked = False

    def __init__(self, lost: Iterable[EntryKey] = (), unreadable: Iterable[EntryKey] = ()) -> None:
        self.lost, self.unreadable = set(lost), set(unreadable)
        self.reads: Counter[EntryKey] = Counter()

    def get(self, key: EntryKey) -> Lookup[Payload]:
        self.reads[key] += 1
        if key in self.unreadable:
            return Lookup.unavailable("held, but every read fails")
        self.lost.discard(key)  # evicted between the offer and this read
        return Lookup.miss()

    def contains(self, key: EntryKey) -> Status:
        return Status.HIT if key in self.lost or key in self.unreadable else Status.MISS

    def put(self, entry: Entry) -> Write:
        return Write.done()

    def drop(self, key: EntryKey) -> None:
        self.lost.discard(key)

    def peek(self, key: EntryKey) -> Lookup[Meta]:
        return Lookup.miss()
