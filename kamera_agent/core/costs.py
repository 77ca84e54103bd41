"""What an operation cost, summed from what each backend primitive reported.

Why from reports: a test that asserts "a slide runs zero forwards" must fail if a forward ran,
so every primitive returns its `Spent` and the meter adds them up; the window adds what only it
knows (patches formed or reused, tokens served from the store, re-encodes forced by a budget,
entries too large to store, chunks forgotten, probes run).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field, fields

from kamera_agent.backends.base import Spent
from kamera_agent.results import OpCost

__all__ = ["CostMeter"]


@dataclass
class CostMeter:
    """Accumulates one operation's costs; ``finish`` gives the immutable `OpCost`."""

    spent: Spent = field(default_factory=Spent)
    tokens_reused: int = 0
    tokens_placed: int = 0
    canonicals_formed: int = 0
    reforms: int = 0
    patches_formed: int = 0
    patches_applied: int = 0
    bytes_added: int = 0
    uncached: int = 0
    forgotten: int = 0
    probes: int = 0
    audits: int = 0
    audit_tokens: int = 0
    drift_fixes: int = 0
    drift_recomputes: int = 0
    drift: float = 0.0
    prefilled: set[str] = field(default_factory=set)
    reused: set[Hashable] = field(default_factory=set)
    began: float = field(default_factory=time.perf_counter)

    def spend(self, spent: Spent) -> None:
        """Add what one primitive call reported."""
        self.spent = self.spent + spent

    def reuse(self, ref: Hashable, chunk_key: str, tokens: int) -> None:
        """Count a chunk's tokens as served without a forward, once per op, unless prefilled."""
        if chunk_key not in self.prefilled and ref not in self.reused:
            self.reused.add(ref)
            self.tokens_reused += tokens

    def finish(self) -> OpCost:
        spent = self.spent
        counted = {name: getattr(self, name) for name in _COUNTED}
        return OpCost(
            forwards=spent.forwards,
            tokens_prefilled=spent.tokens_prefilled,
            vision_encodes=spent.vision_encodes,
            seconds=time.perf_counter() - self.began,
            **counted,
        )


_METERED = frozenset(f.name for f in fields(CostMeter))
_COUNTED = tuple(f.name for f in fields(OpCost) if f.name in _METERED)
"""What the meter counts itself, by the `OpCost` field's name (the rest comes from `Spent`)."""
