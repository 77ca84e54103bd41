"""Per-tier counters from one wrapper: calls, answers, bytes, seconds and errors of any `Tier`.

Why a wrapper: counting inside each tier meant a field per tier in the store's stats and a
gauge per tier in every exporter, so a new tier touched five files. The store wraps every tier
below memory in `InstrumentedTier` (LMCache's ``InstrumentedRemoteConnector`` shape): it
forwards each call, times it and counts its answer, keyed by the tier's name, and the
exporters walk `TierStats` fields without knowing any tier.

    store ──► InstrumentedTier("s3") ──► S3Tier
                 counts: gets by answer, bytes read, puts, bytes written, lookups, errors, seconds

Memory is not wrapped: its hits and bytes are the store's own counters, and its calls are the
hot path. A tier's own numbers (a server's ``up``, bytes queued behind the caller) come through
`Tier.report` into `TierStats.report`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kamera_agent.store.codec import CorruptEntry
from kamera_agent.store.keys import EntryKey
from kamera_agent.store.tier import Entry, Lookup, Meta, Payload, Status, Tier, Write

__all__ = ["InstrumentedTier", "TierGrowth", "TierSeries", "TierStats", "tier_numbers", "tier_series"]

A = TypeVar("A")
R = TypeVar("R")


@dataclass(frozen=True)
class TierStats:
    """What one tier was asked and answered (``StoreStats.tiers[name]``).

    Attributes:
        gets: entries asked for (single or batched).
        hits: gets it answered with an entry (the store may still refuse one: ``rejected``).
        misses: gets it answered without one.
        unavailable: gets, contains and peeks it did not answer (down, slow, past a deadline).
        rejected: entries it held that failed a check (its own or the store's): deleted, never served.
        lookups: contains and peeks (header-only questions).
        puts: entries handed to it (a write-behind tier only queued them).
        puts_refused: puts it did not take (a full queue, a full disk).
        bytes_read: serialized bytes its hits returned (0 for a tier of live values).
        bytes_written: tensor bytes of the entries it took.
        errors: calls that raised (a bug in the tier: the exception goes on to the caller).
        get_seconds / put_seconds / lookup_seconds: time spent in those calls, in all.
        report: the tier's own numbers (`Tier.report`), e.g. ``up`` and ``pending_bytes``.

    Equality compares the counts only: two stores that did the same things compare equal,
    however long each call took.
    """

    gets: int = 0
    hits: int = 0
    misses: int = 0
    unavailable: int = 0
    rejected: int = 0
    lookups: int = 0
    puts: int = 0
    puts_refused: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    # not compared: two stores that did the same things are equal, however long each took
    get_seconds: float = field(default=0.0, compare=False)
    put_seconds: float = field(default=0.0, compare=False)
    lookup_seconds: float = field(default=0.0, compare=False)
    report: dict[str, float] = field(default_factory=dict, compare=False)


class InstrumentedTier(Tier):
    """``inner`` as it is, counted (`TierStats`). Thread-safe as ``inner`` is; its counters always.

    Args:
        inner: the tier to measure; its flags, limit and location are this wrapper's.
        name: the name its counters go by (default ``inner.name``; a store names a second tier
            of one kind ``"<name>_2"``).
    """

    name = "instrumented"

    def __init__(self, inner: Tier, name: str | None = None) -> None:
        self.inner = inner
        self.name = name or inner.name
        self.locked = inner.locked
        self.keyed_by_model = inner.keyed_by_model
        self.written_on_put = inner.written_on_put
        self.limit = inner.limit
        self.location = inner.location
        self._counts: Counter[str] = Counter()
        self._seconds: dict[str, float] = {"get": 0.0, "put": 0.0, "lookup": 0.0}
        self._lock = threading.Lock()

    def get(self, key: EntryKey) -> Lookup[Payload]:
        return self._got([self._timed("get", self.inner.get, key)])[0]

    def get_many(self, keys: Sequence[EntryKey]) -> list[Lookup[Payload]]:
        return self._got(self._timed("get", self.inner.get_many, keys))

    def contains(self, key: EntryKey) -> Status:
        return self._looked([self._timed("lookup", self.inner.contains, key)])[0]

    def contains_many(self, keys: Sequence[EntryKey]) -> list[Status]:
        return self._looked(self._timed("lookup", self.inner.contains_many, keys))

    def peek(self, key: EntryKey) -> Lookup[Meta]:
        answer = self._timed("lookup", self.inner.peek, key)
        self._looked([answer.status])
        return answer

    def put(self, entry: Entry) -> Write:
        write = self._timed("put", self.inner.put, entry)
        with self._lock:
            self._counts["puts"] += 1
            if write.ok:
                self._counts["bytes_written"] += entry.nbytes
            else:
                self._counts["puts_refused"] += 1
        return write

    def drop(self, key: EntryKey) -> None:
        self.inner.drop(key)

    def reject(self, key: EntryKey, why: CorruptEntry) -> None:
        """The store refused what ``inner`` served: ``inner`` deletes it, counted as rejected."""
        with self._lock:
            self._counts["rejected"] += 1
        self.inner.reject(key, why)

    def keys(self) -> list[EntryKey]:
        return self.inner.keys()

    def report(self) -> dict[str, float]:
        return self.inner.report()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> TierStats:
        """The counters so far, with ``inner``'s own report."""
        with self._lock:
            counts, seconds = dict(self._counts), dict(self._seconds)
        return TierStats(
            **counts,
            get_seconds=seconds["get"],
            put_seconds=seconds["put"],
            lookup_seconds=seconds["lookup"],
            report=self.inner.report(),
        )

    def __getattr__(self, attribute: str) -> Any:
        """What only ``inner`` has (a disk tier's ``touch``, a remote tier's ``address``)."""
        if attribute == "inner":  # not set yet (unpickling, a failed __init__): no recursion
            raise AttributeError(attribute)
        return getattr(self.inner, attribute)

    # -- counting --------------------------------------------------------------------------------
    def _timed(self, kind: str, call: Callable[[A], R], argument: A) -> R:
        began = time.perf_counter()
        try:
            return call(argument)
        except Exception:
            with self._lock:
                self._counts["errors"] += 1
            raise
        finally:
            elapsed = time.perf_counter() - began
            with self._lock:
                self._seconds[kind] += elapsed

    def _got(self, answers: list[Lookup[Payload]]) -> list[Lookup[Payload]]:
        with self._lock:
            for answer in answers:
                self._counts["gets"] += 1
                self._counts[_GET_COUNTER[answer.status]] += 1
                if isinstance(answer.found, bytes):
                    self._counts["bytes_read"] += len(answer.found)
        return answers

    def _looked(self, statuses: list[Status]) -> list[Status]:
        with self._lock:
            self._counts["lookups"] += len(statuses)
            for status in statuses:
                if status is Status.UNAVAILABLE or status is Status.REJECTED:
                    self._counts[status.value] += 1
        return statuses


_GET_COUNTER = {
    Status.HIT: "hits",
    Status.MISS: "misses",
    Status.UNAVAILABLE: "unavailable",
    Status.REJECTED: "rejected",
}


def tier_numbers(stats: TierStats) -> dict[str, float]:
    """One tier's counts and seconds (every `TierStats` counter), then what it reports, flat."""
    counted = {name: float(getattr(stats, name)) for name in _HELP}
    return counted | {name: value for name, value in stats.report.items() if name not in _HELP}


def tier_series(tiers: Mapping[str, TierStats | Mapping[str, float]]) -> list[TierSeries]:
    """Every tier's numbers as exporter series, one per `TierStats` field and `Tier.report` entry,
    each with a value per tier name: an exporter (serve's ``/metrics``, an engine's stats) walks
    these and knows no tier. Counts and seconds only grow (counters); reported numbers are gauges.

    ``tiers`` maps a tier's name to its `TierStats`, or to numbers already flat (`tier_numbers`,
    or what `TierGrowth` says grew: a series then has a value for the tiers that name it)."""
    numbers = {t: tier_numbers(s) if isinstance(s, TierStats) else s for t, s in tiers.items()}
    reported = sorted({name for values in numbers.values() for name in values} - set(_HELP))
    return [
        TierSeries(
            f"store_tier_{name}",
            "counter" if name in _HELP else "gauge",
            _HELP.get(name) or f"{name.replace('_', ' ')}, as the tier reports it",
            {tier: values[name] for tier, values in numbers.items() if name in values},
        )
        for name in [*_HELP, *reported]
    ]


class TierGrowth:
    """What tiers did since the last call: for an exporter that is sent differences and adds them
    up (vLLM's connector stats, summed over ranks and steps). Thread-safe.

    A reported number (a gauge) is sent as its change too, so the sums an exporter keeps are, for
    each tier name, the sum of the current values over the processes that report it.
    """

    def __init__(self) -> None:
        self._before: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()

    def since(self, tiers: Mapping[str, TierStats]) -> dict[str, dict[str, float]]:
        """Per tier name, the numbers (`tier_numbers`) that changed since the last call, by how
        much; tiers where none did are left out."""
        now = {tier: tier_numbers(stats) for tier, stats in tiers.items()}
        with self._lock:
            before, self._before = self._before, now
        grown = {tier: _changed(values, before.get(tier, {})) for tier, values in now.items()}
        return {tier: changed for tier, changed in grown.items() if changed}


def _changed(now: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {
        name: value - before.get(name, 0.0) for name, value in now.items() if value != before.get(name, 0.0)
    }


@dataclass(frozen=True)
class TierSeries:
    """One exported series: its name, ``"counter"`` or ``"gauge"``, help text and value per tier."""

    name: str
    kind: str
    help: str
    values: dict[str, float]


_HELP = {
    "gets": "entries asked of the tier",
    "hits": "gets the tier answered with an entry",
    "misses": "gets the tier answered without one",
    "unavailable": "lookups the tier did not answer (down, slow, past a deadline)",
    "rejected": "entries the tier held that failed a check (deleted, never served)",
    "lookups": "contains and peeks asked of the tier",
    "puts": "entries handed to the tier",
    "puts_refused": "puts the tier did not take",
    "bytes_read": "serialized bytes the tier's hits returned",
    "bytes_written": "tensor bytes of the entries the tier took",
    "errors": "tier calls that raised",
    "get_seconds": "seconds spent in the tier's gets",
    "put_seconds": "seconds spent in the tier's puts",
    "lookup_seconds": "seconds spent in the tier's contains and peeks",
}
