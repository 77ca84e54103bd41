"""What an operation cost, summed from what each backend primitive reported.

Why from reports: a test that asserts "a slide runs zero forwards" must fail if a forward ran,
so every primitive returns its `Spent` and the meter adds them up; the window adds what only it
knows (patches formed or reused, tokens served from the store, re-encodes forced by a budget,
entries too large to store, chunks forgotten, probes run).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field, fields

from kamera_agent.backends.base import Spent
from kamera_agent.results import OpCost

__all__ = ["COUNTED", "CostMeter"]


@dataclass
class CostMeter:
    """Accumulates one operation's costs; ``finish`` gives the immutable `OpCost`.

    The counters are `OpCost`'s own fields, by name (`add`), so a field added there is counted
    here with nothing else to change.
    """

    spent: Spent = field(default_factory=Spent)
    counts: Counter[str] = field(default_factory=Counter)
    drift: float = 0.0
    prefilled: set[str] = field(default_factory=set)
    reused: set[Hashable] = field(default_factory=set)
    began: float = field(default_factory=time.perf_counter)

    def add(self, **counts: int) -> None:
        """Count ``name=n`` for each `OpCost` counter named (``reforms=1``, ``audit_tokens=12``)."""
        unknown = [name for name in counts if name not in COUNTED]
        if unknown:
            raise TypeError(f"OpCost has no counter {unknown[0]!r} (one of {', '.join(COUNTED)})")
        self.counts.update(counts)

    def spend(self, spent: Spent) -> None:
        """Add what one primitive call reported."""
        self.spent = self.spent + spent

    def reuse(self, ref: Hashable, chunk_key: str, tokens: int) -> None:
        """Count a chunk's tokens as served without a forward, once per op, unless prefilled."""
        if chunk_key not in self.prefilled and ref not in self.reused:
            self.reused.add(ref)
            self.counts["tokens_reused"] += tokens

    def finish(self) -> OpCost:
        spent = self.spent
        return OpCost(
            forwards=spent.forwards,
            tokens_prefilled=spent.tokens_prefilled,
            vision_encodes=spent.vision_encodes,
            seconds=time.perf_counter() - self.began,
            drift=self.drift,
            **self.counts,
        )


COUNTED = tuple(
    f.name
    for f in fields(OpCost)
    if f.name not in {"forwards", "tokens_prefilled", "vision_encodes", "seconds", "drift"}
)
"""The `OpCost` fields the meter counts itself (the rest come from `Spent`, the clock and ``drift``)."""
