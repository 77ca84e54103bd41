"""Eviction policies: which in-window chunks leave when a push would overflow the capacity.

Each policy ranks the window's chunks; the window evicts in that order until the new chunk
fits. Eviction is reversible (the canonical stays in the store), so a policy trades recall
cost, not correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["EVICTION", "EvictionContext", "EvictionPolicy"]


@dataclass(frozen=True)
class EvictionContext:
    """What a policy may look at.

    Attributes:
        order: in-window chunk refs, left to right.
        last_used: op counter at which each chunk was last pushed, recalled or reordered.
        probe_kl: for the probe-driven policy, a function giving the next-token KL of the last
            query with a chunk switched off (``None`` when no query has been asked yet).
    """

    order: Sequence[Any]
    last_used: Mapping[Any, int]
    probe_kl: Callable[[Any], float] | None = None


EvictionPolicy = Callable[[EvictionContext], list[Any]]
"""Returns the in-window refs in the order they should be evicted."""


def fifo(context: EvictionContext) -> list[Any]:
    """The oldest position first: a sliding window."""
    return list(context.order)


def lru(context: EvictionContext) -> list[Any]:
    """The chunk least recently pushed, recalled or reordered first."""
    return sorted(context.order, key=lambda ref: context.last_used.get(ref, 0))


def disposable(context: EvictionContext) -> list[Any]:
    """The chunk the last query leans on least first (``probe_without`` KL); FIFO before any query."""
    if context.probe_kl is None:
        return fifo(context)
    scores = {ref: context.probe_kl(ref) for ref in context.order}
    return sorted(context.order, key=scores.__getitem__)


EVICTION: Mapping[str, EvictionPolicy] = MappingProxyType(
    {"fifo": fifo, "lru": lru, "disposable": disposable}
)
