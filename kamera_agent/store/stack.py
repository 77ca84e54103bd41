"""The `ChunkStore`'s tiers in order, with its one read path: find, deserialize, verify, promote.

Why a module of its own: the store's facade (typed entry points, limits, stats, persistence)
and the walk over tiers change for different reasons. Here every tier is only a `Tier`: the
walk asks each in order, counts its answer (a tier that did not answer is an outage, never an
absence), and sends every payload through one path, `_admit`, where the integrity check (a
keyed MAC, when the store has a secret) sits beside the address and model checks. Memory is
first and holds live values; what it evicts spills to the disk tier when there is one.

    get:  tier 1 ─miss─► tier 2 ─miss─► … ─► None
            └hit──────────┴hit──► _admit (deserialize, address, model, MAC, stamp) ─► _promote (into memory)
    put:  memory ─► evict ─► spill to disk;  every tier with ``written_on_put`` gets the entry too
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

from kamera_agent.errors import ForeignChunkError
from kamera_agent.store.codec import (
    CorruptEntry,
    StoredValue,
    content_digest,
    deserialize,
    entry_nbytes,
    header_of,
)
from kamera_agent.store.codec import stamp as stamp_fingerprint
from kamera_agent.store.disk import DiskTier
from kamera_agent.store.keys import EntryKey
from kamera_agent.store.memory import MemoryTier
from kamera_agent.store.signing import MAC_FIELD, Signer
from kamera_agent.store.stats import EventLog, StoreEvent
from kamera_agent.store.tier import Entry, Meta, Payload, Status, Tier

__all__ = ["TierStack", "own"]


def own(
    key: EntryKey, value: StoredValue, found: str, fingerprint: str, verb: str, where: str = ""
) -> StoredValue:
    """``value`` stamped with ``fingerprint``, or `ForeignChunkError` when it carries another
    (``found``; ``""`` is unknown and accepted)."""
    if found and found != fingerprint:
        where = f" in {where}" if where else ""
        raise ForeignChunkError(
            f"cannot {verb} {key}{where}: it was made by model {found[:16]}…, this store "
            f"serves {fingerprint[:16]}…. Use one store (and one disk_dir) per model "
            "fingerprint, or let this model form the chunk again."
        )
    return stamp_fingerprint(key.kind, value, fingerprint)


class TierStack:
    """Memory, then the given tiers, slowest last; one lock for the tiers marked ``locked``.

    Args:
        fingerprint: the model every entry must carry.
        memory: the first tier; its victims spill to ``disk``.
        disk: the tier memory spills to, or ``None`` (victims are dropped, and counted).
        below: every tier after memory, in the order a get asks them (``disk`` among them).
        log: where events and counters go (guarded by `lock`).
        signer: with a store secret: entries written are signed, entries read must verify.
    """

    def __init__(
        self,
        fingerprint: str,
        memory: MemoryTier,
        disk: DiskTier | None,
        below: Sequence[Tier],
        log: EventLog,
        signer: Signer | None = None,
    ) -> None:
        self.lock = threading.RLock()
        self.signer = signer
        self.tiers: list[Tier] = [memory, *below]
        self._fingerprint = fingerprint
        self._memory, self._disk, self._log = memory, disk, log
        # the disk's writes go through its place in ``below`` (an `InstrumentedTier` counts them)
        self._disk_writes: Tier | None = next((t for t in below if getattr(t, "inner", t) is disk), disk)

    def get(self, key: EntryKey) -> StoredValue | None:
        """The first tier's verified copy of ``key`` (promoted into memory), or ``None``."""
        memory = self._memory
        with self.lock:  # memory first, spelled out: a live value, checked when it was stored
            answer = memory.get(key)
            found = answer.found
            if found is not None and not isinstance(found, bytes):  # (memory holds no bytes)
                self._log.count("hits")
                self._log.count("memory_hits")
                return found
            self._tally(memory, answer.status, get=True)
        for tier in self.tiers[1:]:
            with self._guard(tier):  # a locked tier's read and promotion are one step
                value = self._read(tier, key)
                if value is not None:
                    with self.lock:
                        self._log.count("hits")
                        self._log.count(f"{tier.name}_hits")
                        return self._promote(tier, key, value)
        with self.lock:
            self._log.count("misses")
        return None

    def put(self, entry: Entry) -> None:
        """Hold ``entry`` in memory (evicting to the limit), then write it to every tier that
        takes puts (a shared tier only queues it: the caller never waits on a network)."""
        self.put_many((entry,))

    def put_many(self, entries: Sequence[Entry]) -> None:
        """`put` of each entry in order: memory takes them all under one lock (each evicting to
        the limit as it arrives), then each tier that takes puts gets them, outside the lock."""
        with self.lock:
            self._log.count("puts", len(entries))
            for entry in entries:
                self._hold(entry)
        for tier in self.tiers[1:]:
            if tier.written_on_put:
                for entry in entries:
                    with self._guard(tier):
                        tier.put(entry)

    def _hold(self, entry: Entry) -> None:
        """Hold ``entry`` in memory and evict to the limit (called under the lock)."""
        key, disk = entry.key, self._disk
        if disk is not None and not disk.written_on_put and key in disk:
            # the same entry again leaves its durable file in place; other bytes under the key make the
            # file stale, and a stale file must never be served (a shared disk is rewritten now)
            disk.remove_if_changed(key, content_digest(key, entry.value, self._fingerprint))
        self._memory.put(entry)
        self._evict(pinned=key)

    def contains(self, key: EntryKey) -> bool:
        """Whether a tier holds ``key``; a tier that does not answer counts as unavailable."""
        for tier in self.tiers:
            if tier.locked:  # (`_guard`, spelled out: a planner asks this for most chunks of an op)
                with self.lock:
                    status = tier.contains(key)
            else:
                status = tier.contains(key)
            if status is Status.HIT:
                return True
            if status is not Status.MISS:
                self._tally(tier, status)
        return False

    def peek(self, key: EntryKey, *, below_memory: bool = False) -> Meta | None:
        """The header metadata of the first tier holding ``key``, or ``None`` (``below_memory``:
        the tiers after memory only, for a caller that has just looked there)."""
        for tier in self.tiers[1:] if below_memory else self.tiers:
            with self._guard(tier):
                answer = tier.peek(key)
            self._tally(tier, answer.status)
            if answer.found is not None:
                return answer.found
        return None

    def limits(self) -> dict[str, int]:
        """``{"memory_limit": …, "disk_limit": …}``: the tiers that bound their bytes."""
        return {f"{tier.name}_limit": tier.limit for tier in self.tiers if tier.limit is not None}

    def write_back(self) -> int:
        """Write every memory entry without a file to disk; how many were written."""
        with self.lock:
            if self._disk is None or self._disk.closed:
                return 0
            written = 0
            for key, resident in self._memory.residents():  # oldest first: the newest files last
                if key not in self._disk:
                    entry = Entry(key, resident.value, resident.nbytes, self._fingerprint, self.signer)
                    assert self._disk_writes is not None
                    written += self._disk_writes.put(entry).ok  # else it stays in memory only, as before
            return written

    def _read(self, tier: Tier, key: EntryKey) -> StoredValue | None:
        answer = tier.get(key)
        self._tally(tier, answer.status, get=True)
        return None if answer.found is None else self._admit(tier, key, answer.found)

    def _admit(self, tier: Tier, key: EntryKey, payload: Payload) -> StoredValue | None:
        """The one deserialize/verify path of every tier's entries: a live value (memory) was checked
        when it was stored; bytes are deserialized, their address and model checked, the value
        stamped. A refused entry is deleted by its tier and counted, never served; one that is
        unsigned or whose MAC does not verify is refused and counted but left where it is (another
        deployment's secret may sign it; this store's next put of the key replaces it)."""
        if not isinstance(payload, bytes):
            return payload
        try:
            address, value, fingerprint = deserialize(payload)  # refuses another entry format by name
            if address != key:
                raise CorruptEntry(f"holds {address}, filed under {key}")
            if tier.keyed_by_model and fingerprint != self._fingerprint:
                raise CorruptEntry(f"made by model {fingerprint[:16]}…")
        except CorruptEntry as exc:
            tier.reject(key, exc)
            self._tally(tier, Status.REJECTED)
            return None
        if self.signer is not None and not self._signed(payload, address, value, fingerprint):
            with self.lock:
                self._log.count("unsigned")
            return None
        return own(key, value, fingerprint, self._fingerprint, "load", tier.location)

    def _signed(self, payload: bytes, address: EntryKey, value: StoredValue, fingerprint: str) -> bool:
        """Whether the entry carries a MAC of what it holds under the store's secret (or a
        previous one): a re-addressed, re-fingerprinted or edited entry does not."""
        assert self.signer is not None
        mac = header_of(payload).get(MAC_FIELD, "")
        return bool(mac) and self.signer.verifies(content_digest(address, value, fingerprint), mac)

    def _promote(self, tier: Tier, key: EntryKey, value: StoredValue) -> StoredValue:
        """Serve ``value`` from ``tier``, held in memory when it fits (called under the lock)."""
        if tier is self._memory:
            return value
        local = self._memory.value_of(key)
        if local is not None:  # put here meanwhile: this process's own value is the newer one
            return local
        nbytes = entry_nbytes(key.kind, value)
        if nbytes <= self._memory.limit:  # else serve it without promoting
            self._memory.put(Entry(key, value, nbytes, self._fingerprint, self.signer))
            self._evict(pinned=key)
        return value

    def _tally(self, tier: Tier, status: Status, *, get: bool = False) -> None:
        """Count one answer: ``unavailable`` (any lookup), ``<tier>_rejected``, and for a get
        ``<tier>_misses`` (``<tier>_errors`` of them unanswered)."""
        if status is Status.HIT or (status is Status.MISS and not get):
            return  # nothing to count: most answers, so no lock taken
        with self.lock:
            if status is Status.UNAVAILABLE:
                self._log.count("unavailable")
            if status is Status.REJECTED:
                self._log.count(f"{tier.name}_rejected")
            elif get:  # a miss or an outage: a hit returned above
                self._log.count(f"{tier.name}_misses")
                if status is Status.UNAVAILABLE:
                    self._log.count(f"{tier.name}_errors")

    def _guard(self, tier: Tier) -> contextlib.AbstractContextManager[Any]:
        """The lock for a tier that is not thread-safe; nothing for one that is (a network)."""
        return self.lock if tier.locked else contextlib.nullcontext()

    def _evict(self, pinned: EntryKey) -> None:
        """Push victims out of memory until it fits its limit: to disk when there is one."""
        while (victim := self._memory.victim(pinned)) is not None:
            resident = self._memory.pop(victim)
            assert resident is not None
            self._log.record(self._spill(victim, resident.value, resident.nbytes))

    def _spill(self, key: EntryKey, value: StoredValue, nbytes: int) -> StoreEvent:
        if self._disk is None or self._disk.closed:
            return StoreEvent(
                "drop", key, nbytes, True, "no disk tier" if self._disk is None else "store closed"
            )
        if key in self._disk:
            self._disk.touch(key)
            return StoreEvent("spill", key, nbytes, False, "already on disk")
        assert self._disk_writes is not None
        write = self._disk_writes.put(Entry(key, value, nbytes, self._fingerprint, self.signer))
        if not write.ok:
            return StoreEvent("drop", key, nbytes, True, write.detail)
        return StoreEvent("spill", key, nbytes, False, "written")
