"""How long a store lookup or write may take in all: what recomputing the entry would cost.

Why: a hit is only worth taking while it is faster than computing the entry again. A shared
tier's per-call timeout bounds each round trip, not a lookup's total: through a slow link a
large entry arrives in a hundred slow pieces, each within the timeout, and the op waits for
all of them: a slow store makes every op slower than computing its entries. So every lookup
and every write of the shared tier has one total deadline, from what the entry saves: the
measured prefill time per token of the engine (a window's backend, an engine's forward) times
the entry's tokens, times a set ``factor``, within a ``floor`` and a ``ceiling``. A lookup that
outlives it is abandoned, counted (``remote_deadline_misses``) and the entry is computed
locally: a hit is never slower than recomputing it by more than ``factor`` (or the floor, for a
small one).

    deadline(tokens) = clamp(factor × seconds_per_token × tokens, floor, ceiling)
    a header-only lookup (contains, peek, an entry's head) = floor
    no prefill measured yet, or an entry whose size is unknown = ceiling
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kamera_agent.moved import renamed

__all__ = ["DeadlineBounds", "Deadlines"]


@dataclass(frozen=True)
class DeadlineBounds:
    """The bounds of every deadline (`kamera_agent.config.WindowConfig`'s ``store_deadline_*``).

    Attributes:
        factor: a hit may take this many times what recomputing its tokens takes.
        floor: seconds every lookup may take at least (a round trip and a header: no entry is
            abandoned for being small); a header-only lookup's whole deadline.
        ceiling: seconds no lookup or write may take, whatever it saves (and the deadline
            before any prefill was measured).
    """

    factor: float = 1.0
    floor: float = 0.5
    ceiling: float = 5.0

    def __post_init__(self) -> None:
        if not (0 < self.floor <= self.ceiling and self.factor > 0):
            raise ValueError(
                f"store deadlines need 0 < floor <= ceiling and factor > 0 (got floor {self.floor}, "
                f"ceiling {self.ceiling}, factor {self.factor})"
            )


class Deadlines:
    """The deadlines of one store, from the prefill time per token its users measure. Thread-safe.

    Args:
        bounds: the factor, floor and ceiling.
        smoothing: the weight of each new measurement in the running estimate.
    """

    def __init__(self, bounds: DeadlineBounds | None = None, smoothing: float = 0.2) -> None:
        self.bounds = bounds or DeadlineBounds()
        self._smoothing = smoothing
        self._per_token: float | None = None
        self._lock = threading.Lock()

    @property
    def seconds_per_token(self) -> float | None:
        """The running estimate of prefill seconds per token (``None``: nothing measured yet)."""
        with self._lock:
            return self._per_token

    def observe(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` tokens took ``seconds`` (its forward alone, no store I/O: a
        measurement that included lookups would lengthen the deadlines of a slow store)."""
        if tokens <= 0 or not seconds > 0:
            return
        rate = seconds / tokens
        with self._lock:
            old = self._per_token
            self._per_token = rate if old is None else old + self._smoothing * (rate - old)

    def for_tokens(self, tokens: int | None) -> float:
        """Seconds a lookup or write of an entry of ``tokens`` tokens may take in all."""
        bounds, rate = self.bounds, self.seconds_per_token
        if tokens is None or rate is None:
            return bounds.ceiling
        return min(bounds.ceiling, max(bounds.floor, bounds.factor * rate * tokens))

    @property
    def header(self) -> float:
        """Seconds a lookup that reads no payload (contains, peek, an entry's head) may take."""
        return self.bounds.floor


__getattr__ = renamed(__name__, {"DeadlinePolicy": "DeadlineBounds"})
"""A policy is a strategy registered by name; these are three numbers: the old name lasts a release."""
