"""Replaying the policies: each step sent to kamera and to the prefix-cache server, side by side.

Why this shape: both servers are the same `KameraServer` over the same model in one process
(``reuse="kamera"`` at the defaults, and ``reuse="prefix"``: exact, as vLLM's and SGLang's
prefix caches reuse), fed the same messages through the official client, the order of the two
alternating from step to step, so their ratios hold on a noisy machine. Each answer is one
greedy token: the prefix server's is a re-prefill's, so equal first tokens are what fidelity
means here, measured at every step, not only at the end.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.progress import Progress

from kamera_agent.replay.policies import POLICIES, Messages
from kamera_agent.replay.screens import DemoScreens, Screens, TextScreens

__all__ = ["SIDES", "ReplayRun", "ReplaySummary", "ScreensFor", "SideStep", "StepRecord", "run_replay"]

SIDES = ("kamera", "prefix")
"""kamera at its defaults, and the same server as a prefix cache (``--reuse prefix``)."""


@dataclass(frozen=True)
class SideStep:
    """One side's answer to one step: client wall time, prompt, the tokens its forwards ran
    (``kamera.tokens_prefilled``: re-formed chunks and the question included), the answer."""

    seconds: float
    prompt_tokens: int
    prefilled: int
    answer: str


@dataclass(frozen=True)
class StepRecord:
    model: str
    policy: str
    step: int
    sides: dict[str, SideStep]

    @property
    def agrees(self) -> bool:
        return self.sides["kamera"].answer == self.sides["prefix"].answer


@dataclass(frozen=True)
class ReplaySummary:
    """One policy on one model: totals over its steps and the first-token agreement."""

    model: str
    policy: str
    steps: int
    tokens: dict[str, int]
    seconds: dict[str, float]
    agreement: float

    @property
    def token_ratio(self) -> float:
        return self.tokens["prefix"] / max(1, self.tokens["kamera"])

    @property
    def wall_ratio(self) -> float:
        return self.seconds["prefix"] / max(1e-9, self.seconds["kamera"])


@dataclass
class ReplayRun:
    """The suite's record: sizes, then every step of every policy on every model."""

    steps: int
    quick: bool
    threads: int
    models: tuple[str, ...]
    policies: tuple[str, ...]
    records: list[StepRecord] = field(default_factory=list)
    seconds: float = 0.0

    def summaries(self) -> list[ReplaySummary]:
        out = []
        for model in self.models:
            for policy in self.policies:
                rows = [r for r in self.records if r.model == model and r.policy == policy]
                if not rows:
                    continue
                out.append(
                    ReplaySummary(
                        model,
                        policy,
                        len(rows),
                        {side: sum(r.sides[side].prefilled for r in rows) for side in SIDES},
                        {side: sum(r.sides[side].seconds for r in rows) for side in SIDES},
                        statistics.fmean(r.agrees for r in rows),
                    )
                )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "quick": self.quick,
            "threads": self.threads,
            "seconds": self.seconds,
            "summaries": [
                {**asdict(s), "token_ratio": s.token_ratio, "wall_ratio": s.wall_ratio}
                for s in self.summaries()
            ],
            "records": [
                {"model": r.model, "policy": r.policy, "step": r.step, "agrees": r.agrees}
                | {side: asdict(step) for side, step in r.sides.items()}
                for r in self.records
            ],
        }


ScreensFor = Callable[[int], Screens]
"""Makes a policy's screens from its seed."""


def run_replay(
    run: ReplayRun,
    backends: dict[str, Any],
    progress: Progress,
    seed: int,
    screens: Mapping[str, ScreensFor] | None = None,
) -> None:
    """Every policy of ``run`` on every backend (by model name), both sides at every step.

    Args:
        screens: each model's screens (default: the demo task's rendered pages for ``"demo"``,
            random letters for any other).

    Mutates: ``run.records`` (a `StepRecord` per step, appended as each finishes).
    """
    from kamera_agent.config import WindowConfig
    from kamera_agent.replay.live import LiveServer
    from kamera_agent.serve import KameraServer, ServeSettings

    began = time.perf_counter()
    try:
        for model in run.models:
            backend = backends[model]
            live = {
                side: LiveServer(
                    KameraServer(
                        backend,
                        ServeSettings(model, WindowConfig(), max_tokens=1, reuse=side, max_sessions=64),
                    )
                )
                for side in SIDES
            }
            try:
                for side in SIDES:  # a warm-up each, outside the records
                    _ask(live[side].client, model, [{"role": "user", "content": "hello"}], "warm-up")
                for index, policy in enumerate(run.policies):  # each its own screens: nothing shared
                    own = seed + 1000 * index
                    make = (screens or {}).get(model, DemoScreens if model == "demo" else TextScreens)
                    requests = POLICIES[policy].requests(make(own), run.steps)
                    task = progress.add_task(f"replay · {model} · {policy}", total=len(requests))
                    for step, messages in enumerate(requests):
                        order = SIDES if step % 2 == 0 else SIDES[::-1]
                        sides = {side: _ask(live[side].client, model, messages, policy) for side in order}
                        run.records.append(StepRecord(model, policy, step, sides))
                        progress.advance(task)
            finally:
                for server in live.values():
                    server.stop()
    finally:
        run.seconds += time.perf_counter() - began


def _ask(client: Any, model: str, messages: Messages, session: str) -> SideStep:
    began = time.perf_counter()
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=1,
        extra_body={"session_id": session},
    )
    seconds = time.perf_counter() - began
    prefilled = int(reply.model_extra["kamera"]["tokens_prefilled"])  # every token a forward ran
    return SideStep(seconds, reply.usage.prompt_tokens, prefilled, reply.choices[0].message.content or "")


def summary_rows(run: ReplayRun) -> Sequence[tuple[str, ...]]:
    """The table's rows: per model and policy, tokens and wall time of both sides, agreement."""
    return [
        (
            s.model,
            s.policy,
            str(s.steps),
            f"{s.tokens['prefix']:,}",
            f"{s.tokens['kamera']:,}",
            f"{s.token_ratio:.2f}×",
            f"{s.seconds['prefix']:.1f}",
            f"{s.seconds['kamera']:.1f}",
            f"{s.wall_ratio:.2f}×",
            f"{100 * s.agreement:.1f} %",
        )
        for s in run.summaries()
    ]
