"""The S3 tier: entries shared through an S3-compatible bucket (AWS, MinIO, Ceph, R2).

Why: an object store is the shared cache a fleet already has; it holds far more than a Valkey
server's memory, at the price of slower round trips. The tier stores each entry as one object
in the Valkey tier's framed format (`kamera_agent.store.remote.framing`: a JSON head with the
payload's sha256, the entry's address, model and tokens, then the payload), so the same checks
hold: a head of another model, address or entry format is refused before the payload is read,
a payload that does not hash to its head is deleted and never served, and the store's MAC
(``store_secret``) is checked on the payload like every tier's.

    put ──► queue (bounded bytes) ──writer thread──► PUT <prefix><model>/<chunk>/<kind>[/<variant>]
    get ──► GET bytes 0-64 KiB (header deadline) ──► head ok? ──► GET the rest, same ETag
             (deadline: what recomputing its tokens costs) ──► sha256 ok? ──► payload

Every call runs by a deadline (`kamera_agent.store.s3.calls`): a bucket that is down or slow is
`Status.UNAVAILABLE` (counted, never taken as the entry's absence) and then skipped for a
backoff, so a lost store costs a lookup nothing. Writes are write-behind: a put never waits
for the network; `flush` waits for the queue.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from kamera_agent.errors import SettingsError
from kamera_agent.store.codec import CorruptEntry, OutdatedEntry
from kamera_agent.store.deadlines import Deadlines
from kamera_agent.store.keys import EntryKey
from kamera_agent.store.remote.framing import HEAD_PEEK, assemble, check_head, frame, read_head
from kamera_agent.store.s3.address import S3Address, parse_s3_url
from kamera_agent.store.s3.admin import clear, usage
from kamera_agent.store.s3.calls import Calls, DeadlineMissed, S3Unavailable
from kamera_agent.store.tier import Entry, Lookup, Meta, Payload, Status
from kamera_agent.store.usage import TierUsage, answered
from kamera_agent.store.write_behind import SharedTier

__all__ = ["S3Tier"]

_LOG = logging.getLogger("kamera_agent.store.s3")
_PLAIN = re.compile(r"^[0-9A-Za-z_.-]{1,128}$")
_ABSENT = {"NoSuchKey", "404", "NotFound", "PreconditionFailed", "412", "InvalidRange", "416"}
"""Error codes that say the object is not there (or changed since its head was read): a miss."""
T = TypeVar("T")
_ADMIN_TIMEOUT = 10.0  # a listing page may take longer than an entry's lookup


class S3Tier(SharedTier[S3Address]):
    """Encoded entries of one model in an S3-compatible bucket. Thread-safe.

    Args:
        address: the bucket, prefix and settings (`parse_s3_url`).
        fingerprint: the model every entry carries (its keys name it).
        deadlines: how long each lookup and write may take in all.
        client: an S3 client to use (default: one made with boto3 from ``address``).

    Raises:
        SettingsError: boto3 is not installed (``pip install 'kamera-agent[s3]'``).
    """

    name = "s3"
    unanswered = S3Unavailable
    cut = DeadlineMissed

    def __init__(
        self, address: S3Address, fingerprint: str, deadlines: Deadlines | None = None, client: Any = None
    ) -> None:
        self._client = client if client is not None else _client(address)
        self._calls = Calls(address.backoff)
        super().__init__(address, fingerprint, deadlines)

    @classmethod
    def parse_url(cls, url: str) -> S3Address:
        """`parse_s3_url`: the bucket and options checked, connecting to nothing."""
        return parse_s3_url(url)

    @classmethod
    def url_usage(cls, url: str, model: str | None = None) -> TierUsage:
        """kamera's objects in the bucket by kind and model (`kamera_agent.store.s3.admin.usage`)."""
        return _admin(url, lambda address, client: usage(address, client, model))

    @classmethod
    def url_clear(cls, url: str, model: str | None = None) -> int:
        """Delete kamera's objects in the bucket (`kamera_agent.store.s3.admin.clear`)."""
        return _admin(url, lambda address, client: clear(address, client, model))

    # -- reads -----------------------------------------------------------------------------------
    def get(self, key: EntryKey) -> Lookup[Payload]:
        """The entry's payload once its sha256 matches its head, all of it by the deadline its
        tokens give (`Deadlines.for_tokens`)."""
        name, began = self._name(key), time.monotonic()

        def look() -> Lookup[Payload]:
            first = self._read(name, f"bytes=0-{HEAD_PEEK - 1}", began + self.deadlines.header)
            if first is None:
                return Lookup.miss()
            prefix, etag = first
            head, inline = read_head(prefix)
            check_head(head, key, self._fingerprint)
            if len(inline) < head.nbytes:  # the rest, of the very object whose head was read
                tokens = head.info.get("tokens", "")
                until = began + self.deadlines.for_tokens(int(tokens) if tokens.isdigit() else None)
                rest = self._read(name, f"bytes={len(prefix)}-", until, etag)
                if rest is None:  # replaced or deleted since its head was read
                    return Lookup.miss()
                inline += rest[0]
            return Lookup.hit(assemble(head, inline, []))

        return self._lookup(key, look)

    def peek(self, key: EntryKey) -> Lookup[Meta]:
        """The entry's codec metadata (a patch's state and meta) from its head alone."""
        name = self._name(key)

        def look() -> Lookup[Meta]:
            first = self._read(name, f"bytes=0-{HEAD_PEEK - 1}", time.monotonic() + self.deadlines.header)
            if first is None:
                return Lookup.miss()
            head, _ = read_head(first[0])
            check_head(head, key, self._fingerprint, peek=True)
            return Lookup.hit(head.info)

        return self._lookup(key, look)

    def contains(self, key: EntryKey) -> Status:
        """Whether the bucket holds the entry (its bytes are checked only when read)."""
        bucket, name = self.address.bucket, self._name(key)

        def exists() -> bool:
            try:
                self._client.head_object(Bucket=bucket, Key=name)
            except Exception as exc:
                if _code(exc) in _ABSENT:
                    return False
                raise
            return True

        try:
            found = self._calls.call(exists, time.monotonic() + self.deadlines.header)
        except S3Unavailable:
            return Status.UNAVAILABLE
        return Status.HIT if found else Status.MISS

    def drop(self, key: EntryKey) -> None:
        """Delete the entry's object (best effort: a bucket that does not answer keeps it)."""
        bucket, name = self.address.bucket, self._name(key)
        with contextlib.suppress(S3Unavailable):
            self._calls.call(
                lambda: self._client.delete_object(Bucket=bucket, Key=name),
                time.monotonic() + self.deadlines.header,
            )

    def reject(self, key: EntryKey, why: CorruptEntry) -> None:
        """Delete an entry that failed a check, so nobody is served it (the store counts it)."""
        tail = "" if isinstance(why, OutdatedEntry) else "; it will be computed again"
        _LOG.warning("s3 store: dropped %s (%s)%s", key, why, tail)
        self.drop(key)

    # -- writes ----------------------------------------------------------------------------------
    def _disconnect(self) -> None:
        self._calls.close()

    def report(self) -> dict[str, float]:
        """``up`` (0 while skipped after failing to answer), ``pending_bytes``, ``outages`` and
        what the writer did behind the caller (writes, failed, skipped, cut at a deadline)."""
        with self._writes.lock:
            counts = dict(self.counts)
        pending = self._writes.pending
        names = ("writes", "writes_failed", "writes_skipped", "deadline_misses", "deadline_writes")
        return {
            "up": 0.0 if self._calls.down else 1.0,
            "pending_bytes": float(pending),
            "outages": float(self._calls.outages),
            **{name: float(counts.get(name, 0)) for name in names},
        }

    # -- internals -------------------------------------------------------------------------------
    def _name(self, key: EntryKey) -> str:
        name = f"{self.address.prefix}{self._fingerprint}/{key.key}/{key.kind}"
        if not key.variant:
            return name
        plain = _PLAIN.match(key.variant)
        return f"{name}/{key.variant if plain else hashlib.sha256(key.variant.encode()).hexdigest()}"

    def _read(self, name: str, span: str, until: float, etag: str | None = None) -> tuple[bytes, str] | None:
        """``(bytes of span, ETag)`` of the object, ``None`` when it is not there (or is no longer
        the object of ``etag``)."""
        bucket, match = self.address.bucket, {"IfMatch": etag} if etag else {}

        def read() -> tuple[bytes, str] | None:
            try:
                answer = self._client.get_object(Bucket=bucket, Key=name, Range=span, **match)
            except Exception as exc:
                if _code(exc) in _ABSENT:
                    return None
                raise
            return answer["Body"].read(), str(answer.get("ETag", ""))

        try:
            return self._calls.call(read, until)
        except DeadlineMissed:
            self._count("deadline_misses")
            raise

    def _write(self, entry: Entry) -> int:
        """One object: the framed head with the payload inline, by the deadline its tokens give;
        the bytes sent."""
        until = time.monotonic() + self.deadlines.for_tokens(entry.tokens)
        payload = entry.serialize()
        _, value, _ = frame(entry.key, self._fingerprint, payload, len(payload), entry.tokens)
        bucket, name = self.address.bucket, self._name(entry.key)
        self._calls.call(lambda: self._client.put_object(Bucket=bucket, Key=name, Body=value), until)
        return len(value)


def _code(exc: Exception) -> str:
    """The S3 error code of a botocore ``ClientError`` (``""`` for any other exception)."""
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def _client(address: S3Address) -> Any:
    """A boto3 S3 client whose every HTTP call is bounded by ``address.timeout`` and tried once
    (the tier's deadlines and backoff decide what happens next, not the client's retries)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise SettingsError(f"{address} needs the boto3 client: pip install 'kamera-agent[s3]'") from None
    config = Config(
        connect_timeout=address.timeout,
        read_timeout=address.timeout,
        retries={"max_attempts": 1, "mode": "standard"},
        s3={"addressing_style": "path"} if address.endpoint else None,
        max_pool_connections=8,
    )
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=address.endpoint, region_name=address.region, config=config)


def _admin(url: str, work: Callable[[S3Address, Any], T]) -> T:
    """``work(address, client)`` for an operator's command, with a patient client; a bucket that
    does not answer, or refuses, is a `StoreUnavailableError`."""
    address = parse_s3_url(url)
    client = _client(replace(address, timeout=max(address.timeout, _ADMIN_TIMEOUT)))
    from botocore.exceptions import BotoCoreError, ClientError

    with answered(address, BotoCoreError, ClientError):
        return work(address, client)
