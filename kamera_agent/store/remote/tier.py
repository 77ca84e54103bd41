"""The remote tier: entries shared through Valkey/Redis by every process that names one URL.

Why: the same frames, screenshots and pages recur across workers and nodes; a canonical, a
vision output or a patch one process computed should cost the others a fetch, not a forward.
The tier moves serialized entries (the store's safetensors bytes) and knows nothing of tensors.

    put ──► queue (bounded bytes) ──writer thread──► parts, then head (SET ... EX ttl)
    get ──► GETRANGE head (64 KiB) ──► format, model, address ok? ──► rest or parts ──► sha256 ok? ──► payload
                                         └ no: DEL, rejected                             └ no: DEL, rejected

A `Tier` (``locked`` off: thread-safe, called outside the store's lock; ``written_on_put``:
every put is queued here). Writes are write-behind: an op never waits for the network; `flush`
waits for the queue. A miss is remembered for a second, so a planner asking "is it there?" of
many absent entries does not pay a round trip each. A server that does not answer is
`Status.UNAVAILABLE` (the store counts it as an error, never as the entry's absence), never an
exception and never a wait beyond the URL's timeout (`Connection`).

Every lookup and write has a total deadline (`Deadlines`): a lookup's head within the floor, the
whole entry within what recomputing its tokens costs (the head says how many); one cut there is
`UNAVAILABLE`, counted in ``deadline_misses`` (``deadline_writes`` for a write), and the caller
computes the entry.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from kamera_agent.store.codec import CorruptEntry, OutdatedEntry
from kamera_agent.store.deadlines import Deadlines
from kamera_agent.store.expiring import Expiring
from kamera_agent.store.keys import EntryKey
from kamera_agent.store.remote.address import RemoteAddress, parse_store_url
from kamera_agent.store.remote.admin import clear, usage
from kamera_agent.store.remote.connection import Connection, DeadlineMissed, RemoteUnavailable
from kamera_agent.store.remote.framing import (
    HEAD_PEEK,
    Head,
    assemble,
    check_head,
    entry_name,
    frame,
    part_names,
    read_head,
)
from kamera_agent.store.tier import Entry, Lookup, Meta, Payload, Status, Write
from kamera_agent.store.usage import TierUsage, answered
from kamera_agent.store.write_behind import SharedTier

__all__ = ["ABSENT_FOR", "RemoteTier"]

_LOG = logging.getLogger("kamera_agent.store.remote")
ABSENT_FOR = 1.0
"""Seconds a miss is remembered: another process's write becomes visible within this time."""


class RemoteTier(SharedTier[RemoteAddress]):
    """Encoded entries of one model on a Valkey/Redis server or cluster.

    Thread-safe. A daemon thread writes in the background; `close` drains it.

    Args:
        address: where the server is (`parse_store_url`).
        fingerprint: the model fingerprint every key and payload carries.
        deadlines: how long each lookup and write may take in all (`Deadlines`; default: its
            policy's ceiling until a prefill is measured).
    """

    name = "remote"
    unanswered = RemoteUnavailable
    cut = DeadlineMissed

    def __init__(self, address: RemoteAddress, fingerprint: str, deadlines: Deadlines | None = None) -> None:
        self._connection = Connection(address)
        self._absent: Expiring[str] = Expiring(ABSENT_FOR)
        super().__init__(address, fingerprint, deadlines)
        self._probe()  # says so at once (one warning) when the server is not there

    @classmethod
    def parse_url(cls, url: str) -> RemoteAddress:
        """`parse_store_url`: scheme, hosts and options checked, connecting to nothing."""
        return parse_store_url(url)

    @classmethod
    def url_usage(cls, url: str, model: str | None = None) -> TierUsage:
        """kamera's entries on the server by kind and model, with its memory limit and policy
        (`kamera_agent.store.remote.admin.usage`: a cursor scan of kamera's keys)."""
        address = cls.parse_url(url)
        with answered(address, RemoteUnavailable):
            return usage(address, model)

    @classmethod
    def url_clear(cls, url: str, model: str | None = None) -> int:
        """Delete kamera's keys on the server (`kamera_agent.store.remote.admin.clear`)."""
        address = cls.parse_url(url)
        with answered(address, RemoteUnavailable):
            return clear(address, model)

    # -- reads -----------------------------------------------------------------------------------
    def get(self, key: EntryKey) -> Lookup[Payload]:
        """The entry's payload once its sha256 matches its head (the store deserializes it), all
        of it by the deadline its head's token count gives (`Deadlines.for_tokens`)."""
        name = self._name(key)
        if name in self._absent:
            return Lookup.miss("absent a moment ago")
        began = time.monotonic()

        def look() -> Lookup[Payload]:
            prefix = self._call(lambda c: c.getrange(name, 0, HEAD_PEEK - 1), began + self.deadlines.header)
            if not prefix:
                self._absent.add(name)
                return Lookup.miss()
            head, inline = read_head(prefix)
            self._check(head, key)
            until = began + self.deadlines.for_tokens(_tokens(head))
            if not head.parts and len(inline) < head.nbytes:  # the rest of an inline value
                whole = self._call(lambda c: c.get(name), until)
                if whole is None:  # deleted since its head was read
                    return Lookup.miss()
                head, inline = read_head(whole)
                self._check(head, key)
            parts = part_names(name, head)
            fetched = self._call(lambda c: _get_all(c, parts), until) if parts else []
            return Lookup.hit(assemble(head, inline, fetched))

        return self._lookup(key, look)

    def peek(self, key: EntryKey) -> Lookup[Meta]:
        """The codec metadata of the entry (a patch's state and meta) without its tensors."""
        name = self._name(key)
        if name in self._absent:
            return Lookup.miss("absent a moment ago")
        until = time.monotonic() + self.deadlines.header

        def look() -> Lookup[Meta]:
            prefix = self._call(lambda client: client.getrange(name, 0, HEAD_PEEK - 1), until)
            if not prefix:
                self._absent.add(name)
                return Lookup.miss()
            head, _ = read_head(prefix)
            self._check(head, key, peek=True)
            return Lookup.hit(head.info)

        return self._lookup(key, look)

    def contains(self, key: EntryKey) -> Status:
        """Whether the server holds the entry's head (its parts are checked only when read)."""
        name = self._name(key)
        if name in self._absent:
            return Status.MISS
        until = time.monotonic() + self.deadlines.header
        try:
            found = bool(self._call(lambda client: client.exists(name), until))
        except RemoteUnavailable:
            return Status.UNAVAILABLE
        if not found:
            self._absent.add(name)
        return Status.HIT if found else Status.MISS

    def drop(self, key: EntryKey) -> None:
        """Delete the entry's head (its parts expire with their TTL or are evicted)."""
        name = self._name(key)
        self._absent.add(name)
        with contextlib.suppress(RemoteUnavailable):
            self._connection.call(lambda client: client.delete(name))

    def reject(self, key: EntryKey, why: CorruptEntry) -> None:
        """Delete an entry that failed a check, so nobody is served it (the store counts it)."""
        tail = "" if isinstance(why, OutdatedEntry) else "; it will be computed again"  # it says so
        _LOG.warning("shared store: dropped %s (%s)%s", key, why, tail)
        self.drop(key)

    # -- writes ----------------------------------------------------------------------------------
    def put(self, entry: Entry) -> Write:
        """Queue the entry (serialized on the writer thread); not ``ok`` when the queue is full (the
        write is skipped and counted: the entry stays local)."""
        write = super().put(entry)
        if write.ok:
            self._absent.discard(self._name(entry.key))
        return write

    def _disconnect(self) -> None:
        self._connection.close()

    # -- accounting ------------------------------------------------------------------------------
    def report(self) -> dict[str, float]:
        """``up`` (1, 0 down, 0.5 slow), ``pending_bytes`` and the writes done behind the caller."""
        r = self.snapshot()
        up = 0.0 if r["state"] == "down" else 0.5 if r["slow"] else 1.0
        names = ("pending_bytes", "writes_failed", "writes_skipped", "deadline_writes", "outages", "timeout")
        return {"up": up, **{name: float(r[name]) for name in names}}

    def snapshot(self) -> dict[str, Any]:
        """Write counters and state: writes, bytes_written, writes_skipped, writes_failed,
        pending_bytes, state (``"up"`` or ``"down"``), outages, the current per-call timeout and
        the slow calls that raised it (the store counts lookups)."""
        with self._writes.lock:
            counts = dict(self.counts)
        pending = self._writes.pending
        return {
            **{name: counts.get(name, 0) for name in _COUNTERS},
            "pending_bytes": pending,
            "state": "down" if self._connection.down else "up",
            "outages": self._connection.outages,
            "timeout": self._connection.timeout,
            "slow_calls": self._connection.slow_calls,
            "slow": self._connection.slow,
        }

    # -- internals -------------------------------------------------------------------------------
    def _name(self, key: EntryKey) -> str:
        return entry_name(self.address.prefix, self._fingerprint, key)

    def _check(self, head: Head, key: EntryKey, *, peek: bool = False) -> None:
        check_head(head, key, self._fingerprint, peek=peek)

    def _call(self, work: Any, until: float) -> Any:
        """A lookup's call by ``until``; one cut there is counted (``deadline_misses``)."""
        try:
            return self._connection.call(work, until)
        except DeadlineMissed:
            self._count("deadline_misses")
            raise

    def _probe(self) -> None:
        with contextlib.suppress(RemoteUnavailable):
            self._connection.call(lambda client: client.ping())

    def _write(self, entry: Entry) -> int:
        """Parts, then the head, all by the deadline the entry's tokens give (a write cut there
        leaves parts no head points at: they expire with their TTL); the bytes sent."""
        key, payload, tokens = entry.key, entry.serialize(), entry.tokens
        until = time.monotonic() + self.deadlines.for_tokens(tokens)
        name = self._name(key)
        head, value, parts = frame(key, self._fingerprint, payload, self.address.part_bytes, tokens)
        expiry = self.address.ttl or None

        def write(client: Any) -> None:
            if parts:  # the parts first: a head only ever points at parts already written
                pipe = client.pipeline(transaction=False)
                for part_name, part in zip(part_names(name, head), parts, strict=True):
                    pipe.set(part_name, part, ex=expiry)
                pipe.execute()
            client.set(name, value, ex=expiry)

        self._connection.call(write, until)
        self._absent.discard(name)
        return len(value) + sum(len(part) for part in parts)


_COUNTERS = (
    "writes",
    "bytes_written",
    "writes_skipped",
    "writes_failed",
    "deadline_misses",
    "deadline_writes",
)


def _tokens(head: Head) -> int | None:
    """The tokens an entry holds, as its head says (``None``: a head written before it said)."""
    tokens = head.info.get("tokens", "")
    return int(tokens) if tokens.isdigit() else None


def _get_all(client: Any, names: list[str]) -> list[bytes | None]:
    """Every key's value in one round trip (they share a hash slot, so a cluster serves it too)."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    return list(pipe.execute())
