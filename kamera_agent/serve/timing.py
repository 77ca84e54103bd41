"""When each phase of a request happened: the figures the latency histograms and the access log
report (``time.perf_counter`` seconds, one clock for all).

Why these phases, as vLLM draws them: an operator asks how long requests wait for the model
(queue), how long until their first token (what a user feels), how fast the rest follows (per
output token) and how long the whole takes. A request here is ``arrived`` (the server took it),
``ready`` (its messages prepared, outside the model), ``started`` (its first turn at the model),
its first token picked (the first decode step: `Clock.stepped`), and ``finished``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Clock"]


@dataclass
class Clock:
    """One request's timestamps; each phase is stamped once, by the thread serving it."""

    arrived: float = field(default_factory=time.perf_counter)
    ready: float | None = None
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def stamp_ready(self) -> None:
        self.ready = time.perf_counter()

    def stamp_started(self) -> None:
        self.started = time.perf_counter()

    def stepped(self) -> None:
        """A decode step is about to pick a token: the first one is the first token's time."""
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def stamp_finished(self) -> None:
        self.finished = time.perf_counter()

    @property
    def queue(self) -> float:
        """Seconds prepared and waiting for the model (vLLM's ``request_queue_time_seconds``)."""
        return _since(self.ready, self.started)

    @property
    def to_first_token(self) -> float:
        """Seconds from arrival to the first token (``time_to_first_token_seconds``); until the
        end when no token was picked (an answer cancelled before it began)."""
        return _since(self.arrived, self.first_token or self.finished)

    @property
    def total(self) -> float:
        """Seconds from arrival to the last token (``e2e_request_latency_seconds``)."""
        return _since(self.arrived, self.finished)

    def per_output_token(self, tokens: int) -> float:
        """Mean seconds between output tokens after the first (vLLM's
        ``request_time_per_output_token_seconds``); 0 for an answer of one token or none."""
        if tokens < 2 or self.first_token is None:
            return 0.0
        return _since(self.first_token, self.finished) / (tokens - 1)


def _since(start: float | None, end: float | None) -> float:
    return max(0.0, end - start) if start is not None and end is not None else 0.0
