"""Measuring what an operation costs, from the backend's own counters.

Why counters, not estimates: a test that asserts "a slide runs zero forwards" must fail if a
forward ran, so costs are read off the backend after the fact; the window adds what only it
knows (patches formed or reused, tokens served from the store, re-encodes forced by a budget).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from kamera_agent.backends.base import BackendCounters
from kamera_agent.results import OpCost, WindowStats

__all__ = ["CostMeter", "StatsBook"]


@dataclass
class CostMeter:
    """Accumulates one operation's window-side counts; ``finish`` adds the backend's."""

    counters: BackendCounters
    start: BackendCounters = field(init=False)
    began: float = field(init=False)
    tokens_reused: int = 0
    reencodes: int = 0
    patches_formed: int = 0
    patches_applied: int = 0
    bytes_added: int = 0
    prefilled: set[object] = field(default_factory=set)
    reused: set[object] = field(default_factory=set)

    def reuse(self, chunk: object, tokens: int) -> None:
        """Count a chunk's tokens as served without a forward, once per op, unless prefilled."""
        if chunk not in self.prefilled and chunk not in self.reused:
            self.reused.add(chunk)
            self.tokens_reused += tokens

    def __post_init__(self) -> None:
        self.start = self.counters.snapshot()
        self.began = time.perf_counter()

    def finish(self) -> OpCost:
        spent = self.counters.since(self.start)
        return OpCost(
            forwards=spent.lm_forwards,
            tokens_prefilled=spent.tokens_prefilled,
            tokens_reused=self.tokens_reused,
            vision_encodes=spent.vision_forwards,
            reencodes=self.reencodes,
            patches_formed=self.patches_formed,
            patches_applied=self.patches_applied,
            bytes_added=self.bytes_added,
            seconds=time.perf_counter() - self.began,
        )


@dataclass
class StatsBook:
    """Per-op and cumulative costs; ``snapshot`` gives the immutable `WindowStats`."""

    last: OpCost = field(default_factory=OpCost)
    total: OpCost = field(default_factory=OpCost)
    by_op: dict[str, OpCost] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)

    def record(self, op: str, cost: OpCost) -> None:
        self.last = cost
        self.total = self.total + cost
        self.by_op[op] = self.by_op.get(op, OpCost()) + cost
        self.ops[op] = self.ops.get(op, 0) + 1

    def snapshot(self) -> WindowStats:
        return WindowStats(self.last, self.total, dict(self.by_op), dict(self.ops))

    def copy(self) -> StatsBook:
        return replace(self, by_op=dict(self.by_op), ops=dict(self.ops))
