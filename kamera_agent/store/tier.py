"""The one seam between the `ChunkStore` and a place that holds entries: the `Tier` protocol.

Why: memory, disk and a shared Valkey/Redis server differ in what they hold (live values or
serialized bytes), how fast they answer and whether they can fail to answer at all, but the
store asks each the same five things: get, put, contains, drop, and a peek at an entry's
header. With one protocol the store composes an ordered list of tiers and keeps a single
deserialize/verify/promote path, and a new tier (or a test's fake) plugs in without touching it.

Every answer is typed: a `Lookup` says `Status.HIT`, `MISS` (the tier answered: it does not
hold the entry), `UNAVAILABLE` (the tier did not answer: nothing is known about the entry, and
the store counts an outage, not an absence) or `REJECTED` (it held bytes that failed the
tier's own check and were deleted, never served).

    Tier (ABC)          holds               called               foreign model's value
    MemoryTier          live values         under the lock       (never holds one)
    DiskTier            serialized files       under the lock       ForeignChunkError (a shared disk_dir)
    RemoteTier          serialized values      outside the lock     rejected (its keys name the model)

Batched methods (`get_many`, `contains_many`) default to loops over the single ones; a tier
that can do better (one pipelined round trip) overrides them.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kamera_agent.errors import StoreURLError
from kamera_agent.store.codec import CorruptEntry, StoredValue, serialize
from kamera_agent.store.deadlines import Deadlines
from kamera_agent.store.keys import EntryKey
from kamera_agent.store.signing import Signer
from kamera_agent.store.usage import TierUsage

__all__ = ["Entry", "Lookup", "Meta", "Payload", "Status", "Tier", "TierContext", "Write"]

Payload = StoredValue | bytes
"""What a tier's get returns: a live value (memory) or the serialized bytes (disk, remote) that the
store deserializes and verifies."""
Meta = dict[str, str]
"""An entry's header metadata (a patch's ``state``, ``meta``, ``num_tokens``, ``patch_kind``)."""
T = TypeVar("T")


class Status(enum.Enum):
    """How a tier answered one lookup."""

    HIT = "hit"
    """It holds the entry (and a get returned it)."""
    MISS = "miss"
    """It answered: it does not hold the entry."""
    UNAVAILABLE = "unavailable"
    """It did not answer (down, timing out, backing off): says nothing about the entry."""
    REJECTED = "rejected"
    """It held bytes that failed its own check (checksum, framing, format): deleted, not served."""


@dataclass(frozen=True)
class Lookup(Generic[T]):
    """One tier's answer to a get (``T`` is `Payload`) or a peek (``T`` is `Meta`).

    Attributes:
        status: what the tier found.
        found: the payload or header; set exactly when ``status`` is `Status.HIT`.
        detail: why, in words, for a status other than a hit (for logs and tests).
    """

    status: Status
    found: T | None = None
    detail: str = ""

    @classmethod
    def hit(cls, found: T) -> Lookup[T]:
        return cls(Status.HIT, found)

    @classmethod
    def miss(cls, detail: str = "") -> Lookup[T]:
        return cls(Status.MISS, None, detail) if detail else _MISS  # frozen: one plain miss serves all

    @classmethod
    def unavailable(cls, detail: str) -> Lookup[T]:
        return cls(Status.UNAVAILABLE, None, detail)

    @classmethod
    def rejected(cls, detail: str) -> Lookup[T]:
        return cls(Status.REJECTED, None, detail)


_MISS: Lookup[Any] = Lookup(Status.MISS)


@dataclass(frozen=True)
class Write:
    """A tier's answer to a put: ``ok``, or ``detail`` says why the entry was not taken."""

    ok: bool
    detail: str = ""

    @classmethod
    def done(cls) -> Write:
        """The entry was taken (one shared answer: frozen, and most puts give it)."""
        return _DONE


_DONE = Write(True)


@dataclass(frozen=True)
class TierContext:
    """What a tier opened from a URL is told by its store: the model every entry must carry
    and the store's deadlines (how long a lookup may take: what recomputing the entry costs)."""

    fingerprint: str
    deadlines: Deadlines


@dataclass(frozen=True)
class Entry:
    """One entry on its way into a tier: the value as the store holds it (stamped with the
    model fingerprint), its tensor bytes, and its encoding, made only when a tier asks for it
    (the remote tier asks on its writer thread, so a put never waits for serialization)."""

    key: EntryKey
    value: StoredValue = field(repr=False)
    nbytes: int
    fingerprint: str
    signer: Signer | None = field(default=None, repr=False)

    def serialize(self) -> bytes:
        """The safetensors bytes of the entry (`kamera_agent.store.codec.serialize`), signed when
        the store has a secret."""
        return serialize(self.key, self.value, self.fingerprint, self.signer)

    @property
    def tokens(self) -> int | None:
        """The tokens the entry holds (a chunk's KV, a patch), ``None`` for other kinds: what
        recomputing it costs is per token (`kamera_agent.store.deadlines`)."""
        tokens = getattr(self.value, "num_tokens", None)
        return tokens if isinstance(tokens, int) else None


class Tier(ABC):
    """A place that holds store entries of one model, asked by the `ChunkStore` in order.

    Capability flags (class attributes) tell the store how to call a tier:

    Attributes:
        name: the tier's name in counters and messages (``"memory"``, ``"disk"``, ``"remote"``);
            the store makes it unique per store (``"remote_2"`` for a second one).
        locked: ``True``: not thread-safe and fast (local), called under the store's lock;
            ``False``: thread-safe and perhaps slow (a network), called outside it so that it
            never blocks other threads' local hits.
        keyed_by_model: its keys name the model fingerprint, so another model's value found
            under one is damage (rejected, never served); otherwise such a value is a store
            shared between models by mistake (`ForeignChunkError`, the fix in its message).
        written_on_put: the store writes every put through to it (a shared tier); otherwise it
            is filled by what the tiers above it evict (the disk tier takes memory's spills).
        limit: the most bytes it holds, or ``None`` (its server's own limit applies); an entry
            larger than any tier's limit is refused before anything is stored.
        location: where it is, for messages (``""`` when there is nothing to say).
    """

    name: str
    locked: bool = True
    keyed_by_model: bool = False
    written_on_put: bool = False
    limit: int | None = None
    location: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "name", ""):  # counters are named after it: two tiers must not share one
            raise TypeError(f"{cls.__name__} needs a name (a class attribute, e.g. name = 'disk')")

    @abstractmethod
    def get(self, key: EntryKey) -> Lookup[Payload]:
        """The entry (a live value, or bytes the store deserializes and verifies), counted as a use."""

    @abstractmethod
    def put(self, entry: Entry) -> Write:
        """Store ``entry`` (replacing what ``entry.key`` held); a write-behind tier only queues it."""

    @abstractmethod
    def contains(self, key: EntryKey) -> Status:
        """`Status.HIT` when the tier holds ``key`` (not verified: a get may still reject it)."""

    @abstractmethod
    def drop(self, key: EntryKey) -> None:
        """Forget ``key`` if held (no accounting: the caller knows why)."""

    @abstractmethod
    def peek(self, key: EntryKey) -> Lookup[Meta]:
        """The entry's header metadata without its tensors and without counting a use."""

    def reject(self, key: EntryKey, why: CorruptEntry) -> None:
        """Delete an entry the store refused after decoding it (wrong address, model, format), so
        it is never served; tiers that report losses override this to say so."""
        self.drop(key)

    def get_many(self, keys: Sequence[EntryKey]) -> list[Lookup[Payload]]:
        """`get` of each key, in order (override to batch round trips)."""
        return [self.get(key) for key in keys]

    def contains_many(self, keys: Sequence[EntryKey]) -> list[Status]:
        """`contains` of each key, in order (override to batch round trips)."""
        return [self.contains(key) for key in keys]

    def keys(self) -> list[EntryKey]:
        """The keys the tier can list cheaply; a shared tier lists none (it holds every process's)."""
        return []

    @classmethod
    def from_url(cls, url: str, context: TierContext) -> Tier:
        """The tier ``url`` names, for the model and deadlines of ``context``: how a store's
        ``store_url`` becomes a tier (`kamera_agent.store.registry`). A tier opened only by
        hand (memory, disk, a test's fake) keeps this refusal."""
        raise TypeError(f"{cls.__name__} cannot be opened from a URL: give it a from_url classmethod")

    @classmethod
    def url_usage(cls, url: str, model: str | None = None) -> TierUsage:
        """Count kamera's entries at ``url`` (of ``model`` only, when given): ``kamera store
        stats``. A shared tier that can list what it holds overrides this refusal.

        Raises:
            StoreURLError: this tier cannot list its entries.
            StoreUnavailableError: the place did not answer.
        """
        raise StoreURLError(f"{cls.__name__} ({url.partition(':')[0]}://) cannot count its entries: {_ADMIN}")

    @classmethod
    def url_clear(cls, url: str, model: str | None = None) -> int:
        """Delete kamera's entries at ``url`` (of ``model`` only, when given), returning how many
        keys went: ``kamera store clear``. Overridden like `url_usage`."""
        raise StoreURLError(
            f"{cls.__name__} ({url.partition(':')[0]}://) cannot delete its entries: {_ADMIN}"
        )

    @classmethod  # noqa: B027  (an optional hook: nothing to check by default)
    def check_url(cls, url: str) -> None:
        """Refuse a URL this tier could never open (`StoreURLError`, naming the fix) before any
        store is built: settings are checked when they are made, not at the first lookup. It
        connects to nothing."""

    def report(self) -> dict[str, float]:
        """What only this tier knows, as numbers (``up``, queued bytes, writes failed behind the
        caller's back): exported beside the counters `InstrumentedTier` keeps, by name."""
        return {}

    def flush(self) -> None:  # noqa: B027  (an optional hook: a no-op unless overridden)
        """Finish queued writes (a write-behind tier); nothing to do by default."""

    def close(self) -> None:  # noqa: B027  (an optional hook: a no-op unless overridden)
        """Finish and release what the tier holds open (idempotent); nothing to do by default."""


_ADMIN = "use the tools of the place that holds them, or give the tier url_usage and url_clear classmethods"
