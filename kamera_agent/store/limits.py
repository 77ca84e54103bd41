"""Byte limits of the store's tiers, and the eviction policies: which entry leaves a tier first
when its byte limit is exceeded.

Why: the right victim depends on the workload (an agent replaying old screenshots wants LRU, a
video stream wants FIFO, a store full of large pages may prefer to drop the largest first).
Each policy is a scoring function registered by name; the tier evicts the entry with the
*lowest* score, ties broken by least recent use. A new policy is a one-line function, either
passed to the store directly or looked up here by name, never an if/elif on a string.

    policy          score (lowest leaves first)
    lru             last use tick
    fifo            insertion tick
    lfu             hit count
    largest_first   minus the entry's bytes
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Mapping
from types import MappingProxyType
from typing import Protocol, TypeVar

from kamera_agent.errors import StoreLimitError

__all__ = [
    "EVICTION_POLICIES",
    "EntryInfo",
    "EvictionPolicy",
    "check_fits",
    "check_limit",
    "either_name",
    "pick_victim",
    "resolve_policy",
    "store_limits",
]


class EntryInfo(Protocol):
    """What a policy may read about an entry: bytes and logical-clock ticks (no wall time)."""

    @property
    def nbytes(self) -> int: ...

    @property
    def inserted(self) -> int: ...

    @property
    def last_used(self) -> int: ...

    @property
    def hits(self) -> int: ...


EvictionPolicy = Callable[[EntryInfo], float]
K = TypeVar("K", bound=Hashable)


def _lru(info: EntryInfo) -> float:
    return float(info.last_used)


def _fifo(info: EntryInfo) -> float:
    return float(info.inserted)


def _lfu(info: EntryInfo) -> float:
    return float(info.hits)


def _largest_first(info: EntryInfo) -> float:
    return -float(info.nbytes)


EVICTION_POLICIES: Mapping[str, EvictionPolicy] = MappingProxyType(
    {"lru": _lru, "fifo": _fifo, "lfu": _lfu, "largest_first": _largest_first}
)
"""Read-only registry (no global mutable state): pass a callable to the store for a new policy."""


def resolve_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """The scoring function for a registered name, or ``policy`` itself when it is a callable."""
    if callable(policy):
        return policy
    try:
        return EVICTION_POLICIES[policy]
    except KeyError:
        names = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(
            f"unknown eviction policy {policy!r}; use one of {names}, or pass a scoring function "
            "(EntryInfo) -> float whose lowest score is evicted first"
        ) from None


def pick_victim(
    entries: Mapping[K, EntryInfo], policy: EvictionPolicy, *, pinned: K | None = None
) -> K | None:
    """The key of the entry to evict first (lowest score, then least recently used), never ``pinned``.

    A linear scan is fine at the entry counts a store holds (thousands), and keeps every policy
    a pure score of one entry.
    """
    best: tuple[float, int] | None = None
    victim: K | None = None
    for key, info in entries.items():
        rank = (policy(info), info.last_used)
        if key != pinned and (best is None or rank < best):
            best, victim = rank, key
    return victim


def check_limit(name: str, limit: int) -> None:
    """Raise `StoreLimitError` unless ``limit`` is a positive whole number of bytes."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise StoreLimitError(f"{name} must be a positive number of bytes, got {limit!r}")


def check_fits(what: str, nbytes: int, limits: Mapping[str, int]) -> None:
    """Raise `StoreLimitError` when one entry alone exceeds a limit: it could never be stored.

    Checked before anything is stored, so a refused put changes nothing.
    """
    for name, limit in limits.items():
        if nbytes > limit:
            raise StoreLimitError(
                f"{what} takes {nbytes} bytes but {name} is {limit} bytes: raise {name} above "
                "the largest entry (a chunk's canonical is tokens × bytes_per_token)"
            )


def either_name(old: str, old_value: int | None, new: str, value: int | None) -> int | None:
    """``value``, or ``old_value`` given under the setting's old name ``old`` (with a
    `DeprecationWarning` naming ``new``): byte caps are *limits*, "budget" is the drift budget's."""
    if old_value is None:
        return value
    if value is not None:
        raise StoreLimitError(f"{old} is the old name of {new}: pass {new} alone")
    warnings.warn(f"{old} is now {new}", DeprecationWarning, stacklevel=3)
    return old_value


def store_limits(
    memory_limit: int | None, disk_dir: object, disk_limit: int | None
) -> tuple[int, int | None]:
    """A store's memory and disk limits, checked before anything is built: a memory limit always,
    a disk limit with a disk folder and only with one."""
    if memory_limit is None:
        raise StoreLimitError("a store needs memory_limit: the most tensor bytes it holds in memory")
    check_limit("memory_limit", memory_limit)
    if (disk_dir is None) != (disk_limit is None):
        raise StoreLimitError(
            "disk_dir and disk_limit go together: pass both for a disk tier (e.g. "
            "disk_limit=20 << 30 for 20 GiB), or neither for a memory-only store"
        )
    if disk_limit is not None:
        check_limit("disk_limit", disk_limit)
    return memory_limit, disk_limit
