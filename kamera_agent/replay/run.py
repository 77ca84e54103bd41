"""Replaying the policies: each step sent to kamera and to the prefix-cache server, side by side.

Why this shape: both servers are the same `KameraServer` over the same model in one process
(``reuse="kamera"`` at the defaults, and ``reuse="prefix"``: exact, as vLLM's and SGLang's
prefix caches reuse), fed the same messages through the official client, the order of the two
alternating from step to step and from pass to pass (each pass on fresh servers). On a shared
machine one forward's time moves by tens of per cent with the load, so the wall figure is the
median over every step of kamera's wall over the prefix server's for that step, and each side's
time outside the model's forwards (its own work) is reported beside it. Each answer is one
greedy token: the prefix server's is a re-prefill's, so equal first tokens are what fidelity
means here, measured at every step, not only at the end. The answer continues an opening
(`ANSWER_START`, sent as a final assistant message under ``continue_final_message``), so that
its first token names what the model read on the screen, not how answers begin.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.progress import Progress

from kamera_agent.bench.forward_clock import ForwardClock
from kamera_agent.replay.policies import POLICIES, Messages
from kamera_agent.replay.screens import DemoScreens, Screens, TextScreens

__all__ = [
    "ANSWER_START",
    "SIDES",
    "ReplayRun",
    "ReplaySummary",
    "ScreensFor",
    "SideStep",
    "StepRecord",
    "run_replay",
]

ANSWER_START = 'Next action: click "'
"""The opening each step's answer continues: its first token is the element the model picks."""

SIDES = ("kamera", "prefix")
"""kamera at its defaults, and the same server as a prefix cache (``--reuse prefix``)."""


@dataclass(frozen=True)
class SideStep:
    """One side's answer to one step: client wall time, the part of it inside the model's
    forwards, prompt, the tokens its forwards ran (``kamera.tokens_prefilled``: re-formed chunks
    and the question included), the answer."""

    seconds: float
    forward_seconds: float
    prompt_tokens: int
    prefilled: int
    answer: str

    @property
    def rest_ms(self) -> float:
        """Milliseconds outside the model's forwards: the server's own work, HTTP included."""
        return (self.seconds - self.forward_seconds) * 1e3


@dataclass(frozen=True)
class StepRecord:
    model: str
    policy: str
    step: int
    sides: dict[str, SideStep]
    repeat: int = 0
    """Which pass over the policy (each on fresh servers, the side order flipped from the last)."""

    @property
    def agrees(self) -> bool:
        return self.sides["kamera"].answer == self.sides["prefix"].answer

    def ratio(self, measure: Callable[[SideStep], float]) -> float:
        """kamera's ``measure`` over the prefix server's for this step."""
        return measure(self.sides["kamera"]) / max(1e-9, measure(self.sides["prefix"]))


@dataclass(frozen=True)
class ReplaySummary:
    """One policy on one model over every pass: the first pass's tokens, both sides' wall over
    all passes, the first-token agreement, and the noise-robust wall figures.

    Attributes:
        wall_over_prefix: the median over every pass's steps of kamera's wall over the prefix
            server's for that step (< 1: kamera is faster). Both sides of a step run back to back
            on the same request, so a burst of load on a shared machine moves one step's ratio,
            not the median.
        pass_walls: each pass's total kamera wall over the prefix server's.
        in_forwards: the median per-step ratio of the time inside the model's forwards alone (the
            same shapes on both sides where tokens are equal: how far the machine's noise goes).
        rest_ms: per side, the median per step of its wall outside the model's forwards.
    """

    model: str
    policy: str
    steps: int
    passes: int
    tokens: dict[str, int]
    seconds: dict[str, float]
    agreement: float
    wall_over_prefix: float
    pass_walls: tuple[float, ...]
    in_forwards: float
    rest_ms: dict[str, float]

    @classmethod
    def of(cls, rows: list[StepRecord]) -> ReplaySummary:
        """The summary of one policy's records on one model (every pass's)."""
        first, passes = rows[0], sorted({r.repeat for r in rows})
        per_pass = [[r for r in rows if r.repeat == n] for n in passes]
        return cls(
            first.model,
            first.policy,
            len(per_pass[0]),
            len(passes),
            {side: sum(r.sides[side].prefilled for r in per_pass[0]) for side in SIDES},
            {side: sum(r.sides[side].seconds for r in rows) for side in SIDES},
            statistics.fmean(r.agrees for r in rows),
            statistics.median(r.ratio(_wall) for r in rows),
            tuple(_total(mine, "kamera") / max(1e-9, _total(mine, "prefix")) for mine in per_pass),
            statistics.median(r.ratio(_in_forwards) for r in rows),
            {side: statistics.median(r.sides[side].rest_ms for r in rows) for side in SIDES},
        )

    @property
    def token_ratio(self) -> float:
        """The prefix server's tokens over kamera's (above 1: kamera prefilled fewer)."""
        return self.tokens["prefix"] / max(1, self.tokens["kamera"])


def _wall(step: SideStep) -> float:
    return step.seconds


def _in_forwards(step: SideStep) -> float:
    return step.forward_seconds


def _total(rows: list[StepRecord], side: str) -> float:
    return sum(r.sides[side].seconds for r in rows)


@dataclass
class ReplayRun:
    """The suite's record: sizes, then every step of every policy on every model, every pass."""

    steps: int
    quick: bool
    threads: int
    models: tuple[str, ...]
    policies: tuple[str, ...]
    passes: int = 1
    records: list[StepRecord] = field(default_factory=list)
    seconds: float = 0.0

    def summaries(self) -> list[ReplaySummary]:
        out = []
        for model in self.models:
            for policy in self.policies:
                rows = [r for r in self.records if r.model == model and r.policy == policy]
                if rows:
                    out.append(ReplaySummary.of(rows))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "passes": self.passes,
            "quick": self.quick,
            "threads": self.threads,
            "seconds": self.seconds,
            "answer_start": ANSWER_START,
            "summaries": [{**asdict(s), "token_ratio": s.token_ratio} for s in self.summaries()],
            "records": [
                {"model": r.model, "policy": r.policy, "pass": r.repeat, "step": r.step, "agrees": r.agrees}
                | {side: asdict(step) | {"rest_ms": step.rest_ms} for side, step in r.sides.items()}
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
    """Every policy of ``run`` on every backend (by model name), both sides at every step, in
    ``run.passes`` passes (each on fresh servers, its side order the last one's flipped).

    Args:
        screens: each model's screens (default: the demo task's rendered pages for ``"demo"``,
            random letters for any other).

    Mutates: ``run.records`` (a `StepRecord` per step, appended as each finishes).
    """
    began = time.perf_counter()
    try:
        for model in run.models:
            make = (screens or {}).get(model, DemoScreens if model == "demo" else TextScreens)
            requests = {  # each policy its own screens: nothing shared
                policy: POLICIES[policy].requests(make(seed + 1000 * index), run.steps)
                for index, policy in enumerate(run.policies)
            }
            tasks = {
                policy: progress.add_task(f"replay · {model} · {policy}", total=len(asked) * run.passes)
                for policy, asked in requests.items()
            }
            clock = ForwardClock(backends[model], SIDES)
            with clock.installed():
                for number in range(run.passes):
                    live = _servers(backends[model], model, clock)
                    try:
                        for policy, asked in requests.items():
                            for step, messages in enumerate(asked):
                                order = SIDES if (step + number) % 2 == 0 else SIDES[::-1]
                                sides = {side: live[side].ask(messages, policy) for side in order}
                                run.records.append(StepRecord(model, policy, step, sides, number))
                                progress.advance(tasks[policy])
                    finally:
                        for server in live.values():
                            server.live.stop()
    finally:
        run.seconds += time.perf_counter() - began


@dataclass(frozen=True)
class _Side:
    """One side's server, reached through the official client, its forwards timed by ``clock``."""

    name: str
    model: str
    live: Any
    clock: ForwardClock

    def ask(self, messages: Messages, session: str) -> SideStep:
        self.clock.side = self.name
        forwards = self.clock.spent[self.name]
        began = time.perf_counter()
        opening = {"role": "assistant", "content": ANSWER_START}
        continued = {"continue_final_message": True, "add_generation_prompt": False}
        reply = self.live.client.chat.completions.create(
            model=self.model,
            messages=[*messages, opening],
            temperature=0,
            max_tokens=1,
            extra_body={"session_id": session, **continued},
        )
        seconds = time.perf_counter() - began
        forward_seconds = (self.clock.spent[self.name] - forwards) / 1e3
        prefilled = int(reply.model_extra["kamera"]["tokens_prefilled"])  # every token a forward ran
        answer = reply.choices[0].message.content or ""
        return SideStep(seconds, forward_seconds, reply.usage.prompt_tokens, prefilled, answer)


def _servers(backend: Any, model: str, clock: ForwardClock) -> dict[str, _Side]:
    """Both sides' servers, fresh (no session or store entry of an earlier pass), each warmed up
    by one request outside the records."""
    from kamera_agent.config import WindowConfig
    from kamera_agent.replay.live import LiveServer
    from kamera_agent.serve import KameraServer, ServeSettings

    live = {}
    for side in SIDES:
        settings = ServeSettings(model, WindowConfig(), max_tokens=1, reuse=side, max_sessions=64)
        live[side] = _Side(side, model, LiveServer(KameraServer(backend, settings)), clock)
        live[side].ask([{"role": "user", "content": "hello"}], "warm-up")
    return live
