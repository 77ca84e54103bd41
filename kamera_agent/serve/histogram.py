"""Latency histograms in Prometheus' text format, named as vLLM names its own.

Why written here rather than with ``prometheus_client``: the server already writes its counters
in the text format (`kamera_agent.serve.metrics`), a histogram is a few cumulative counts, and
the client library would bring a dependency and a process-wide default registry for them. The
buckets are vLLM's, so a dashboard built for ``vllm:`` series reads ``kamera:`` ones unchanged.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["LATENCY", "TIME_PER_TOKEN", "TIME_TO_FIRST_TOKEN", "Histogram"]

# fmt: off
TIME_TO_FIRST_TOKEN = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
"""vLLM's buckets for ``time_to_first_token_seconds``."""
TIME_PER_TOKEN = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
"""vLLM's buckets for the time per output token."""
LATENCY = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
"""vLLM's buckets for end-to-end latency and queue time."""
# fmt: on


@dataclass
class Histogram:
    """Observations counted into cumulative buckets (not thread-safe: `Metrics` holds the lock).

    Attributes:
        name: the full metric name (``kamera:time_to_first_token_seconds``).
        help_text: what one observation is.
        bounds: the buckets' upper bounds, ascending (``+Inf`` is added).
    """

    name: str
    help_text: str
    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def render(self) -> list[str]:
        """The histogram's lines: ``_bucket`` (cumulative, ``le`` labels), ``_sum``, ``_count``."""
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip([*map(repr, map(float, self.bounds)), "+Inf"], self.counts, strict=True):
            running += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {running}')
        lines += [f"{self.name}_sum {self.total!r}", f"{self.name}_count {running}"]
        return lines
