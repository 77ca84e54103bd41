"""The content-addressed `ChunkStore`: canonicals, vision embeddings, patches and audits, over ordered tiers.

Why: every reuse in kamera-agent starts with a lookup by content key. A hit skips the vision
encode and the canonical prefill (or, for a patch, the conditioned forward), so the store is
what makes eviction reversible (DESIGN invariant 4). It composes an ordered list of tiers, each
behind the one `Tier` protocol (`kamera_agent.store.tier`): memory within a byte limit, an
optional disk tier with its own limit, an optional shared Valkey/Redis tier (``remote=``),
then any ``tiers=`` given. Nothing leaves silently: every spill, drop, disk eviction, corrupt
or outdated file is a `StoreEvent` and a counter.

    put ──► memory (limit, policy) ──evict──► disk (limit, LRU files) ──evict──► gone (counted)
     └────► every tier written on put (remote: queued, written behind)
    get ──► memory ─miss─► disk ─miss─► remote ─miss─► … ──► None: the caller computes it
              │hit           │hit         │hit (each: HIT, MISS, UNAVAILABLE or REJECTED)
              └──────────────┴────────────┴──► one path: deserialize ─► address ─► model ─► stamp
                                                     └ refused: the tier deletes it, counted, miss
                                               ──► promote into memory (within its limit) ──► hit

A tier that does not answer (`Status.UNAVAILABLE`: a server down or timing out) is counted as
``unavailable`` (and ``remote_errors``), never taken as the entry's absence; it only costs the
caller the entry. Tiers marked ``locked`` (memory, disk) are called under one `threading.RLock`
(simple, and correct: no entry is ever half-moved between them); the others (remote) are
called outside it, so a slow network never blocks other threads' local hits.

Tiers are inclusive: a promoted entry keeps its file, so evicting it again costs no write.
Entries carry the store's model fingerprint; an entry of another model is refused on put and
on load with `ForeignChunkError` (a tier whose keys name the model rejects it instead).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, cast

import torch

from kamera_agent.errors import StoreKeyError
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.operator.patch import Patch
from kamera_agent.store.audits import DriftAudit
from kamera_agent.store.codec import StoredValue, entry_nbytes, fingerprint_of
from kamera_agent.store.deadlines import DeadlineBounds, Deadlines
from kamera_agent.store.disk import DiskTier
from kamera_agent.store.instrumented import InstrumentedTier, TierStats
from kamera_agent.store.keys import EntryKey
from kamera_agent.store.limits import EvictionPolicy, check_fits, either_name, resolve_policy, store_limits
from kamera_agent.store.memory import MemoryTier
from kamera_agent.store.registry import TIERS, TierRegistry
from kamera_agent.store.remote import RemoteAddress, RemoteTier
from kamera_agent.store.remote.stats import remote_stats
from kamera_agent.store.signing import Signer
from kamera_agent.store.stack import TierStack, own
from kamera_agent.store.stats import EventLog, StoreEvent, StoreStats
from kamera_agent.store.tier import Entry, Tier, TierContext

__all__ = ["ChunkStore", "Written"]

T = TypeVar("T")


@dataclass(frozen=True)
class Written:
    """What `ChunkStore.put_many` did: entries stored, their tensor bytes, and entries skipped
    because one alone exceeds a limit (they could never be stored)."""

    stored: int
    nbytes: int
    too_large: int


def _flush_at_exit(store: weakref.ReferenceType[ChunkStore]) -> None:
    alive = store()
    if alive is not None:
        with contextlib.suppress(Exception):  # exit must not fail over a cache
            alive.flush()


class ChunkStore:
    """Content-addressed canonicals, vision embeddings and patches of one model.

    Example:
        >>> store = ChunkStore(fingerprint=fp, memory_limit=2 << 30, disk_dir="cache", disk_limit=20 << 30)
        >>> store.put_canonical(kv)  # kv.chunk_key is the content key
        >>> store.get_canonical(kv.chunk_key)  # the same tensors, or None: form it again

    Returned tensors are the stored ones (no copy): treat them as read-only, as `apply_patch`
    does. Entries read back from disk are on the CPU.

    Args:
        fingerprint: the model fingerprint (`kamera_agent.model_fingerprint`) every entry
            must carry; entries that carry none are stamped with it.
        memory_limit: most tensor bytes held in memory.
        disk_dir: directory of the disk tier; ``None`` for memory only (evicted entries are
            then dropped, and counted).
        disk_limit: most file bytes held in ``disk_dir`` (required with it).
        memory_budget: the old name of ``memory_limit``: still taken, with a `DeprecationWarning`.
        disk_budget: the old name of ``disk_limit``: still taken, with a `DeprecationWarning`.
        disk_shared: every put is written to ``disk_dir`` at once (not only what memory
            evicts), so the other processes of this machine that open it read it: an engine's
            scheduler and workers, several servers. Any number of processes may open one
            ``disk_dir`` at a time either way (`kamera_agent.store.disk`).
        policy: memory eviction policy, a name in `EVICTION_POLICIES` or a scoring function.
        disk_policy: which file leaves the disk tier first.
        event_capacity: how many recent `StoreEvent` are kept (counters keep counting).
        remote: a shared Valkey/Redis tier: its URL (``redis://host:6379/0``, ``valkey://``,
            ``redis+cluster://h1:p1,h2:p2``; options in `kamera_agent.store.remote.address`)
            or a parsed `RemoteAddress`; ``None`` for a store of this process alone.
        urls: further tiers by URL, asked after ``remote`` in order (``s3://bucket/prefix``, a
            second ``redis://``): each URL's scheme names its tier (`kamera_agent.store.registry`).
        tiers: further `Tier` s asked after memory, disk and the URLs' tiers, fastest first (e.g.
            a cache of another kind); the store closes them with itself.
        registry: the schemes URLs are opened by (default: `kamera_agent.store.registry.TIERS`,
            where a third party registers its tiers).
        secret: a shared secret (else ``$KAMERA_STORE_SECRET``): every entry written to disk or
            to the shared tier is signed with it, and one read from them must verify under it
            or a ``previous_secrets`` one (else ``$KAMERA_STORE_PREVIOUS_SECRETS``): a forged
            entry is refused (`kamera_agent.store.signing`). Without one, anyone who can write
            to the disk directory or the server is trusted fully.
        deadlines: how long a shared-tier lookup or write may take in all (factor, floor and
            ceiling); the prefill time per token it scales with is what the store's users report
            to `deadlines` (`Deadlines.observe`).

    Raises:
        StoreLimitError: a limit that is not a positive byte count, or a disk directory
            without a disk limit (or the reverse).
        StoreKeyError: an empty fingerprint.
        StoreURLError: a remote URL kamera cannot use (`UnknownTierSchemeError`: a scheme no
            tier is registered for).
        SettingsError: a URL whose tier's client library is not installed (``valkey``, ``boto3``).
    """

    def __init__(
        self,
        *,
        fingerprint: str,
        memory_limit: int | None = None,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_limit: int | None = None,
        policy: str | EvictionPolicy = "lru",
        disk_policy: str | EvictionPolicy = "lru",
        event_capacity: int = 1024,
        remote: str | RemoteAddress | None = None,
        urls: Sequence[str] = (),
        tiers: Sequence[Tier] = (),
        registry: TierRegistry | None = None,
        secret: str | bytes | None = None,
        previous_secrets: Sequence[str | bytes] = (),
        disk_shared: bool = False,
        deadlines: DeadlineBounds | None = None,
        memory_budget: int | None = None,
        disk_budget: int | None = None,
    ) -> None:
        memory_limit, disk_limit = store_limits(
            either_name("memory_budget", memory_budget, "memory_limit", memory_limit),
            disk_dir,
            either_name("disk_budget", disk_budget, "disk_limit", disk_limit),
        )
        if not fingerprint:
            raise StoreKeyError(
                "a store needs the fingerprint of its model: kamera_agent.model_fingerprint(model)"
            )
        self._fingerprint = fingerprint
        self._log = EventLog(event_capacity)
        self._closed = False
        self.deadlines = Deadlines(deadlines)
        """How long a shared-tier lookup or write may take; report prefill times to it (`observe`)."""
        self._memory = MemoryTier(memory_limit, resolve_policy(policy))
        signer = Signer.from_settings(secret, previous_secrets)
        spill_policy = resolve_policy(disk_policy)
        # every setting checked above: a URL's tier may start threads and connections now
        opened = _open_urls(remote, urls, TierContext(fingerprint, self.deadlines), registry or TIERS)
        self._disk: DiskTier | None = None
        if disk_dir is not None and disk_limit is not None:
            try:
                in_memory = self._memory.__contains__
                self._disk = DiskTier(
                    Path(disk_dir), disk_limit, spill_policy, self._log, in_memory, shared=disk_shared
                )
            except BaseException:
                for tier in opened:  # a failed build leaves nothing running
                    tier.close()
                raise
            atexit.register(_flush_at_exit, weakref.ref(self))  # durable without an explicit flush
        self._remote = next((tier for tier in opened if isinstance(tier, RemoteTier)), None)
        local = [self._disk] if self._disk is not None else []
        self._below = _instrumented([*local, *opened, *tiers])
        self._stack = TierStack(fingerprint, self._memory, self._disk, self._below, self._log, signer)
        self._lock = self._stack.lock
        self._companions: dict[str, Any] = {}

    @property
    def fingerprint(self) -> str:
        """The model fingerprint every entry of this store carries."""
        return self._fingerprint

    @property
    def disk_dir(self) -> Path | None:
        return None if self._disk is None else self._disk.directory

    @property
    def remote(self) -> RemoteAddress | None:
        """The shared tier's address (no password), or ``None``."""
        return None if self._remote is None else self._remote.address

    @property
    def tiers(self) -> dict[str, str]:
        """Every tier below memory, by name, with where it is (no password): ``{"disk":
        "/cache", "remote": "redis://host:6379/0", "s3": "s3://bucket/prefix"}``."""
        return {tier.name: tier.location for tier in self._below}

    @property
    def shared(self) -> list[str]:
        """Where the tiers every process shares are (those written on each put, the disk
        excepted): what a log line names as this store's reach."""
        return [
            tier.location or tier.name
            for tier in self._below
            if tier.written_on_put and tier.inner is not self._disk
        ]

    # --- typed entry points -------------------------------------------------------------

    def companion(self, key: str, make: Callable[[], T]) -> T:
        """The object filed under ``key`` beside this store, made by ``make`` on first use: what
        the users of one store share besides its entries (a drift budget's learned fix shares)."""
        with self._lock:
            if key not in self._companions:
                self._companions[key] = make()
            found: T = self._companions[key]
            return found

    def put_canonical(self, kv: ChunkKV) -> EntryKey:
        """Store a chunk's canonical KV under ``kv.chunk_key``; returns its address."""
        return self._put(EntryKey.canonical(kv.chunk_key), kv)

    def get_canonical(self, key: str) -> ChunkKV | None:
        """The canonical stored under content key ``key``, or ``None``: form it again."""
        return cast("ChunkKV | None", self._get(EntryKey.canonical(key)))

    def put_full(self, kv: ChunkKV, state: str) -> EntryKey:
        """Store the position-free KV of the full-rank chunk state ``state`` (a digest) of
        ``kv.chunk_key``: a full-rank patch stored as the KV itself (smaller than its factors, and
        usable without the chunk's canonical)."""
        return self._put(EntryKey.full(kv.chunk_key, state), kv)

    def get_full(self, chunk_key: str, state: str) -> ChunkKV | None:
        """The KV of ``chunk_key`` in full-rank state ``state``, or ``None``: form it again."""
        return cast("ChunkKV | None", self._get(EntryKey.full(chunk_key, state)))

    def has_full(self, chunk_key: str, state: str) -> bool:
        """Whether the KV of this full-rank chunk state is held, without loading it."""
        return self.contains(EntryKey.full(chunk_key, state))

    def put_vision(self, key: str, outputs: Mapping[str, torch.Tensor]) -> EntryKey:
        """Store a vision tower's outputs (e.g. embeddings plus deepstack features) under ``key``."""
        _check_vision(outputs)
        return self._put(EntryKey.vision(key), dict(outputs))

    def get_vision(self, key: str) -> dict[str, torch.Tensor] | None:
        """The vision outputs stored under ``key``, or ``None``: run the vision tower again."""
        return cast("dict[str, torch.Tensor] | None", self._get(EntryKey.vision(key)))

    def put_patch(self, patch: Patch, variant: str | None = None) -> EntryKey:
        """Store a patch under ``(patch.chunk_key, variant)``; the variant defaults to the state
        the patch gives (``patch.state``), an orbit passes its set key. Returns its address."""
        return self._put(EntryKey.patch(patch.chunk_key, patch.state if variant is None else variant), patch)

    def get_patch(self, chunk_key: str, variant: str) -> Patch | None:
        """The patch of ``chunk_key`` filed under ``variant``, or ``None``: form it again."""
        return cast("Patch | None", self._get(EntryKey.patch(chunk_key, variant)))

    def patch_info(self, chunk_key: str, variant: str) -> tuple[str, dict[str, str]] | None:
        """``(state digest, meta)`` of the patch filed under ``variant``, read without loading its
        tensors or counting a hit (a planner's peek); ``None`` when no tier holds it."""
        key = EntryKey.patch(chunk_key, variant)
        with self._lock:
            live = self._memory.value_of(key)
        if isinstance(live, Patch):  # memory answers first: what its header would say, unencoded
            return live.state, {str(k): str(v) for k, v in live.meta.items()}
        header = self._stack.peek(key, below_memory=True)  # memory was asked just above
        if header is None or "state" not in header:
            return None
        try:
            meta = json.loads(header.get("meta", "{}"))
        except ValueError:
            return None
        return header["state"], {str(k): str(v) for k, v in meta.items()}

    def put_audit(self, audit: DriftAudit) -> EntryKey:
        """File a measured drift (`DriftAudit`) under its chunk, state and left context."""
        return self._put(EntryKey.audit(audit.chunk_key, audit.state, audit.left), audit)

    def get_audit(self, chunk_key: str, state: str, left: str) -> DriftAudit | None:
        """The drift measured for ``chunk_key`` in ``state`` behind ``left``, or ``None``: not
        measured (or no longer held)."""
        return cast("DriftAudit | None", self._get(EntryKey.audit(chunk_key, state, left)))

    def has_canonical(self, key: str) -> bool:
        """Whether a canonical for this chunk key is held (any tier), without loading it."""
        return self.contains(EntryKey.canonical(key))

    def has_vision(self, key: str) -> bool:
        """Whether vision outputs for this pixel key are held (any tier), without loading them."""
        return self.contains(EntryKey.vision(key))

    def has_patch(self, chunk_key: str, variant: str) -> bool:
        """Whether a patch for this chunk and variant is held, without loading it."""
        return self.contains(EntryKey.patch(chunk_key, variant))

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` tensor bytes can be stored at all (every limit holds it)."""
        return all(nbytes <= limit for limit in self._stack.limits().values())

    def get(self, key: EntryKey) -> StoredValue | None:
        """The entry at ``key`` whatever its kind (the typed getters above say which type), or
        ``None``; for callers that hold an address, as the engines' loads and a staged op do."""
        return self._stack.get(key)

    def put(self, key: EntryKey, value: StoredValue) -> EntryKey:
        """Store ``value`` at ``key`` (of the kind ``key.kind`` names); for callers that hold an
        address (the typed ``put_*`` make the address from the value)."""
        return self._put(key, value)

    def put_many(self, entries: Iterable[tuple[EntryKey, StoredValue]]) -> Written:
        """Store each ``(address, value)`` in order, as `put` would, under one lock; an entry
        larger than a limit is skipped and counted instead of refused (an operation's commit:
        such an entry was used without being stored). Every entry is checked before any is
        stored, so one that fails a check (`StoreKeyError`, `ForeignChunkError`) stores none."""
        limit = min(self._stack.limits().values(), default=None)
        batch: list[Entry] = []
        nbytes = too_large = 0
        for key, value in entries:
            size = entry_nbytes(key.kind, value)
            if limit is not None and size > limit:
                too_large += 1
                continue
            if key.kind == "vision":
                assert isinstance(value, dict)
                _check_vision(value)
            batch.append(self._entry(key, value, size))
            nbytes += size
        self._stack.put_many(batch)
        return Written(len(batch), nbytes, too_large)

    def contains(self, key: EntryKey) -> bool:
        """Whether a tier holds ``key``. A disk or remote copy is verified only when read, so a
        get can still miss (and ``corrupt_dropped`` or ``remote_rejected`` says why)."""
        return self._stack.contains(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, EntryKey) and self.contains(key)

    def keys(self) -> list[EntryKey]:
        """Every address the local tiers hold, sorted (the shared tier is not listed: it holds
        every process's entries; ``kamera store stats`` counts them)."""
        with self._lock:
            return sorted(set().union(*(tier.keys() for tier in self._stack.tiers if tier.locked)))

    # --- accounting ---------------------------------------------------------------------

    def stats(self) -> StoreStats:
        """A consistent snapshot of counters and occupancy."""
        with self._lock:
            c, disk = self._log.counts, self._disk
            return StoreStats(
                puts=c["puts"],
                hits=c["hits"],
                memory_hits=c["memory_hits"],
                disk_hits=c["disk_hits"],
                misses=c["misses"],
                memory_bytes=self._memory.nbytes,
                memory_limit=self._memory.limit,
                memory_entries=len(self._memory),
                disk_bytes=0 if disk is None else disk.nbytes,
                disk_limit=0 if disk is None else disk.limit,
                disk_entries=0 if disk is None else len(disk),
                evictions=c["spill"] + c["drop"],
                spills=c["spill"],
                dropped=c["drop"],
                disk_evictions=c["disk_evict"],
                corrupt_dropped=c["corrupt"],
                lost=c["lost"],
                outdated_dropped=c["outdated"],
                unavailable=c["unavailable"],
                unsigned_refused=c["unsigned"],
                tiers=self.tier_stats(),
                **remote_stats(self._remote, self._log.counts),
            )

    def tier_stats(self) -> dict[str, TierStats]:
        """``stats().tiers`` alone, without the store's lock: what an engine reads every step."""
        return {tier.name: tier.stats() for tier in self._below}

    def events(self) -> list[StoreEvent]:
        """The most recent events, oldest first (the log keeps ``event_capacity`` of them)."""
        with self._lock:
            return self._log.recent()

    def drain_events(self) -> list[StoreEvent]:
        """The recent events, clearing the log (counters are kept)."""
        with self._lock:
            return self._log.drain()

    # --- persistence --------------------------------------------------------------------

    def flush(self) -> int:
        """Write every memory entry that has no file yet to disk; returns how many were written.

        Spills happen on eviction anyway, and `close` and interpreter exit flush too, so a new
        process reopening ``disk_dir`` finds the entries that were still in memory.
        """
        for tier in self._stack.tiers:
            with self._lock if tier.locked else contextlib.nullcontext():
                tier.flush()
        return self._stack.write_back()

    @property
    def closed(self) -> bool:
        """`close` was called: windows over this store refuse further ops (`WindowClosedError`)."""
        return self._closed

    def close(self) -> None:
        """Write every memory entry to the disk tier, release its directory (another process may
        open it now) and finish the shared tier's queued writes. Idempotent; a store still open
        at interpreter exit is flushed then (`with` or ``close`` makes it deterministic)."""
        self._closed = True
        for tier in self._stack.tiers:  # the shared ones first: their queued writes finish
            if not tier.locked:
                tier.close()
        self._stack.write_back()
        with self._lock:
            for tier in self._stack.tiers:
                if tier.locked:
                    tier.close()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- the two generic paths -----------------------------------------------------------

    def _put(self, key: EntryKey, value: StoredValue) -> EntryKey:
        entry = self._entry(key, value, entry_nbytes(key.kind, value))
        check_fits(str(key), entry.nbytes, self._stack.limits())
        self._stack.put(entry)
        return key

    def _entry(self, key: EntryKey, value: StoredValue, nbytes: int) -> Entry:
        """``value`` on its way into the tiers: its address checked, its model owned (stamped)."""
        if not key.key:
            raise StoreKeyError(
                f"a {key.kind} needs its chunk's content key: set chunk_key (dataclasses.replace) "
                "before storing it"
            )
        value = own(key, value, fingerprint_of(key.kind, value), self._fingerprint, "put")
        return Entry(key, value, nbytes, self._fingerprint, self._stack.signer)

    def _get(self, key: EntryKey) -> StoredValue | None:
        return self._stack.get(key)


def _open_urls(
    remote: str | RemoteAddress | None, urls: Sequence[str], context: TierContext, registry: TierRegistry
) -> list[Tier]:
    """The tiers ``remote`` and ``urls`` name, in order, opened by their schemes (all checked
    before any is opened: a bad URL opens nothing)."""
    if isinstance(remote, RemoteAddress):
        return [RemoteTier(remote, context.fingerprint, context.deadlines), *registry.open_all(urls, context)]
    return registry.open_all([*([remote] if remote is not None else []), *urls], context)


def _instrumented(tiers: Sequence[Tier]) -> list[InstrumentedTier]:
    """Each tier counted under its name, made unique (a second ``remote`` is ``remote_2``)."""
    seen: Counter[str] = Counter()
    wrapped = []
    for tier in tiers:
        seen[tier.name] += 1
        count = seen[tier.name]
        wrapped.append(InstrumentedTier(tier, tier.name if count == 1 else f"{tier.name}_{count}"))
    return wrapped


def _check_vision(outputs: Mapping[str, torch.Tensor]) -> None:
    if "__metadata__" in outputs:
        raise StoreKeyError("'__metadata__' is reserved by safetensors; rename that vision output")
