"""Eviction policies: which in-window chunks leave when a push would overflow the capacity.

Each policy ranks the window's chunks; the window evicts in that order until the new chunk
fits. Eviction is reversible (the canonical stays in the store), so a policy trades recall
cost, not correctness. A policy that needs probe scores says so (``probes=True``): the planner
then asks for them only when a push really overflows, and a dry run lists the probes instead
of running them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["EVICTION", "Eviction", "EvictionContext", "EvictionRanking"]


@dataclass(frozen=True)
class EvictionContext:
    """What a policy may look at.

    Attributes:
        order: in-window chunk refs, left to right.
        last_used: op counter at which each chunk was last pushed, recalled or reordered.
        scores: for probe-driven policies, the next-token KL of the last query with each chunk
            switched off (``None`` when no query has been asked yet).
    """

    order: Sequence[Any]
    last_used: Mapping[Any, int]
    scores: Mapping[Any, float] | None = None


EvictionRanking = Callable[[EvictionContext], list[Any]]
"""Returns the in-window refs in the order they should be evicted."""


@dataclass(frozen=True)
class Eviction:
    """A named eviction strategy: its ranking and whether it needs probe scores first."""

    rank: EvictionRanking
    probes: bool = False


def fifo(context: EvictionContext) -> list[Any]:
    """The oldest position first: a sliding window."""
    return list(context.order)


def lru(context: EvictionContext) -> list[Any]:
    """The chunk least recently pushed, recalled or reordered first."""
    return sorted(context.order, key=lambda ref: context.last_used.get(ref, 0))


def disposable(context: EvictionContext) -> list[Any]:
    """The chunk the last query leans on least first (``probe_without`` KL); FIFO before any query."""
    if context.scores is None:
        return fifo(context)
    scores = context.scores
    return sorted(context.order, key=lambda ref: scores.get(ref, 0.0))


EVICTION: Mapping[str, Eviction] = MappingProxyType(
    {"fifo": Eviction(fifo), "lru": Eviction(lru), "disposable": Eviction(disposable, probes=True)}
)
