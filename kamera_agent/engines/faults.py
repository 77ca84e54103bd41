"""Faults caught at an engine hook's boundary: counted, logged once per kind, never raised.

Why: kamera inside an engine is an optimisation. A fault in kamera's code at run time (a bug, a
store that times out, an entry of an unexpected shape) must cost the engine the reuse for that
request, never the request or the engine. Every per-request hook catches at its boundary,
records the fault here and degrades to what the engine does without kamera ("no external
tokens", a load failure under the engine's own policy). Configuration and layout errors are
different: they raise at startup, where an operator sees them.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

__all__ = ["HookFaults"]


class HookFaults:
    """Counts of runtime faults by ``hook:ExceptionType``; the first of each kind is logged."""

    def __init__(self, logger: logging.Logger) -> None:
        self.counts: Counter[str] = Counter()
        self._logger = logger
        self._lock = threading.Lock()

    def caught(self, hook: str, exc: BaseException) -> None:
        """Record ``exc`` raised inside ``hook`` (logged with its traceback the first time)."""
        name = type(exc).__name__
        why = "the engine goes on without kamera for it"
        self._record(f"{hook}:{name}", f"{hook} failed ({name}: {exc}); {why}", exc)

    def count(self, hook: str, kind: str, detail: str) -> None:
        """Record a fault that is no exception (a load that found its entry gone), as ``hook:kind``,
        logged the first time."""
        self._record(f"{hook}:{kind}", f"{hook}: {kind} ({detail}); the engine computes those tokens")

    def _record(self, key: str, message: str, exc: BaseException | None = None) -> None:
        with self._lock:
            first = key not in self.counts
            self.counts[key] += 1
        if first:
            self._logger.warning(
                "kamera: %s (logged once per kind, counted in the adapter's stats)", message, exc_info=exc
            )

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)
