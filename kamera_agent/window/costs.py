"""A window's running record of what its operations cost.

Why separate from the meter: `kamera_agent.core.CostMeter` sums one operation; the book keeps
the last, the cumulative and the per-op totals, and copies with the window's state (a fork
starts from its parent's record; a failed op records nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kamera_agent.results import OpCost, WindowStats

__all__ = ["StatsBook"]


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
        known = self.by_op.get(op)
        self.by_op[op] = cost if known is None else known + cost
        self.ops[op] = self.ops.get(op, 0) + 1

    def snapshot(self) -> WindowStats:
        return WindowStats(self.last, self.total, dict(self.by_op), dict(self.ops))

    def copy(self) -> StatsBook:
        return StatsBook(self.last, self.total, dict(self.by_op), dict(self.ops))  # every op: no replace()
