"""An engine's prefill time per token, measured where its forward runs, for the store's deadlines.

Why: a store lookup is worth waiting for only while it is faster than computing the entry again
(`kamera_agent.store.deadlines`), and what computing costs is the engine's own forward time per
token on its own hardware. An adapter marks where a forward begins and ends with the tokens it
computed; on CUDA the marks are events read once the forward is done (never a sync on the
step), elsewhere the wall clock. Steps of fewer than `MIN_TOKENS` tokens (decode steps) are not
counted: their time per token is not a prefill's.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from kamera_agent.store.deadlines import Deadlines

__all__ = ["MIN_TOKENS", "PrefillClock"]

MIN_TOKENS = 32
"""Fewer tokens in a forward than this: not a prefill worth measuring."""


class PrefillClock:
    """Measures forwards and reports them to ``deadlines`` (`Deadlines.observe`).

    Not thread-safe: one engine thread calls `began` and `ended` in turn.
    """

    def __init__(self, deadlines: Deadlines) -> None:
        self.deadlines = deadlines
        self._start: Any = None
        self._pending: deque[tuple[Any, Any, int]] = deque(maxlen=64)  # CUDA events not yet done

    def began(self, device: Any = None) -> None:
        """A forward starts now (``device``: its torch device; CUDA is timed by events)."""
        if getattr(device, "type", None) == "cuda":
            import torch

            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def ended(self, tokens: int) -> None:
        """The forward begun last computed ``tokens`` tokens and ends now."""
        start, self._start = self._start, None
        if start is not None and tokens >= MIN_TOKENS:
            if isinstance(start, float):
                self.deadlines.observe(tokens, time.perf_counter() - start)
            else:
                import torch

                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((start, end, tokens))
        self._read_done()

    def _read_done(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, end, tokens = self._pending.popleft()
            self.deadlines.observe(tokens, start.elapsed_time(end) / 1000.0)
