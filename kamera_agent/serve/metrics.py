"""``GET /metrics``: the server's counters in Prometheus' text format.

Why these: an operator wants to see that reuse happens (tokens prefilled against served from
reuse, forwards, ops by kind), what it costs (store bytes, sessions) and how long requests take.
The usage counters are sums of what each response's ``usage`` said, so the two can be
reconciled; the latency histograms carry vLLM's names after a ``kamera:`` prefix
(`kamera_agent.serve.histogram`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from kamera_agent.results import OpCost
from kamera_agent.serve.histogram import LATENCY, TIME_PER_TOKEN, TIME_TO_FIRST_TOKEN, Histogram
from kamera_agent.serve.timing import Clock
from kamera_agent.serve.usage import PromptSplit
from kamera_agent.store.instrumented import TierStats, tier_series

__all__ = ["Metrics"]


class Metrics:
    """Thread-safe counters; ``render`` adds the gauges ``gauges()`` reports at scrape time and
    every store tier's series (``kamera_store_tier_hits_total{tier="s3"}``, from ``tiers()``)."""

    def __init__(
        self,
        gauges: Callable[[], dict[str, float]],
        tiers: Callable[[], Mapping[str, TierStats]] = dict,
    ) -> None:
        self._lock = threading.Lock()
        self._gauges = gauges
        self._tiers = tiers
        self.counts: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()
        self.sources: Counter[str] = Counter()
        self.ttft = Histogram(
            "kamera:time_to_first_token_seconds",
            "seconds from a request's arrival to its first answer token",
            TIME_TO_FIRST_TOKEN,
        )
        self.per_token = Histogram(
            "kamera:request_time_per_output_token_seconds",
            "a request's mean seconds per answer token after its first (vLLM's per-request series; its "
            "per-token vllm:time_per_output_token_seconds is deprecated)",
            TIME_PER_TOKEN,
        )
        self.e2e = Histogram(
            "kamera:e2e_request_latency_seconds",
            "seconds from a request's arrival to its last token",
            LATENCY,
        )
        self.queue = Histogram(
            "kamera:request_queue_time_seconds",
            "seconds a request, its messages prepared, waited for its first turn at the model",
            LATENCY,
        )

    def request(self, status: int) -> None:
        with self._lock:
            self.statuses[status] += 1

    def served(
        self,
        usage: dict[str, Any],
        split: PromptSplit,
        spent: int,
        ops: list[tuple[str, OpCost]],
        *,
        cancelled: bool = False,
    ) -> None:
        """A served request: its usage, where its prompt came from, the forward work on its prompt
        side (``spent``), and the cost of every op it ran (the ask included)."""
        with self._lock:
            self.counts["prompt_tokens"] += usage["prompt_tokens"]
            self.counts["cached_tokens"] += usage["prompt_tokens_details"]["cached_tokens"]
            self.counts["completion_tokens"] += usage["completion_tokens"]
            self.counts["tokens_beyond_prompt"] += max(0, spent - usage["prompt_tokens"])
            self.counts["cancelled"] += int(cancelled)
            for source, tokens in split.as_dict().items():
                self.sources[source] += tokens
            for op, cost in ops:
                self.ops[op] += 1
                self.counts["tokens_prefilled"] += cost.tokens_prefilled
                self.counts["tokens_reused"] += cost.tokens_reused
                self.counts["forwards"] += cost.forwards
                self.counts["vision_encodes"] += cost.vision_encodes

    def timed(self, clock: Clock, tokens: int) -> None:
        """A served request's latencies (``tokens``: the answer tokens of all its choices)."""
        with self._lock:
            self.ttft.observe(clock.to_first_token)
            self.per_token.observe(clock.per_output_token(tokens))
            self.e2e.observe(clock.total)
            self.queue.observe(clock.queue)

    def after_cancel(self, tokens: int) -> None:
        """Answer tokens decoded after a request's client was seen to go away."""
        with self._lock:
            self.counts["tokens_after_cancel"] += tokens

    def released(self, caches: int) -> None:
        """Windows' engine caches released to stay within the server's byte limit."""
        with self._lock:
            self.counts["window_caches_released"] += caches

    def render(self) -> str:
        with self._lock:
            counts, ops, statuses = dict(self.counts), dict(self.ops), dict(self.statuses)
            sources = dict(self.sources)
            histograms = [
                line for h in (self.ttft, self.per_token, self.e2e, self.queue) for line in h.render()
            ]
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP kamera_{name} {help_text}")
            lines.append(f"# TYPE kamera_{name} {kind}")
            lines.extend(f"kamera_{name}{labels} {value:g}" for labels, value in samples)

        metric(
            "requests_total",
            "counter",
            "chat completion requests by HTTP status",
            [(f'{{status="{s}"}}', n) for s, n in sorted(statuses.items())] or [("", 0)],
        )
        for name, help_text in (
            ("prompt_tokens", "prompt tokens of served requests (usage.prompt_tokens)"),
            ("cached_tokens", "prompt tokens served from reuse (usage.prompt_tokens_details.cached_tokens)"),
            ("completion_tokens", "generated tokens (usage.completion_tokens)"),
            ("tokens_prefilled", "tokens every forward processed (prompts, formations, decode steps)"),
            ("tokens_reused", "chunk tokens served from the store with no forward"),
            ("forwards", "language-model forwards run"),
            ("vision_encodes", "vision-tower runs"),
            ("tokens_beyond_prompt", "prompt-side tokens forwards computed beyond the prompt (re-forming)"),
            ("cancelled", "requests whose client went away during the answer (generation stopped)"),
            ("tokens_after_cancel", "answer tokens decoded after a client was seen to go away"),
            ("window_caches_released", "windows' engine caches released to stay within --window-cache-bytes"),
        ):
            metric(f"{name}_total", "counter", help_text, [("", counts.get(name, 0))])
        metric(
            "prompt_tokens_by_source_total",
            "counter",
            "prompt tokens by where they came from (as vLLM's vllm:prompt_tokens_by_source): prefix, "
            "relocated, patched, kept (approximate), prefilled; they add up to prompt_tokens_total",
            [(f'{{source="{k}"}}', n) for k, n in sorted(sources.items())] or [("", 0)],
        )
        metric(
            "ops_total",
            "counter",
            "window ops by kind",
            [(f'{{op="{op}"}}', n) for op, n in sorted(ops.items())] or [("", 0)],
        )
        for name, value in sorted(self._gauges().items()):
            metric(name, "gauge", name.replace("_", " "), [("", value)])
        for series in tier_series(self._tiers()):  # every tier below memory, by name: no tier known here
            if not series.values:
                continue
            total = "_total" if series.kind == "counter" else ""
            samples = [(f'{{tier="{tier}"}}', value) for tier, value in sorted(series.values.items())]
            metric(f"{series.name}{total}", series.kind, series.help, samples)
        return "\n".join([*lines, *histograms]) + "\n"
