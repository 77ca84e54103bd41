"""kamera's wall beside the prefix cache's at equal tokens: agents under `WindowConfig.exact()`
on the 1.5B-class slice, both sides in one process, alternating step by step and run by run.

Why: under the exact settings kamera prefills what a prefix cache prefills (or fewer, where a
stored state serves), so whatever wall it spends beyond the prefix cache's is its own work: the
planner, placing and reading chunk KV, the store's books. This measures that ratio where it
matters (a forward of a 1.5B-class model's width, not the demo model's millisecond one), and
splits each side's wall into the model's forwards and the rest, so a ratio off 1.0 can be read
as more forwards (a step's ops not sharing one), more tokens, or kamera's own work. On a shared
machine one run's ratio moves by several per cent with the load; the median over alternating
runs is the figure, and each side's rest (its wall outside the forwards) says how much of any
gap is kamera's own.

The agents: **sliding** (a window of 8 chunks of 64 tokens, each step pushes one, the oldest
sliding out, and asks; the steps that fill the window are run untimed), and the agents suite's
**video**, **web** and **document** agents at its token sizes with fewer steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.agents.contents import RandomContents
from kamera_agent.bench.agents.run import QUICK_SHAPE, realistic_backend, warm
from kamera_agent.bench.agents.script import Script
from kamera_agent.bench.agents.scripts import AGENTS, QUICK_TOKENS, REALISTIC_TOKENS, AgentCounts
from kamera_agent.bench.agents.sides import KameraSide, PrefixSide
from kamera_agent.bench.forward_clock import ForwardClock
from kamera_agent.config import WindowConfig
from kamera_agent.models.random_qwen2 import QWEN2_1_5B_SLICE

__all__ = [
    "AGENT_NAMES",
    "PREFIX_OVERHEAD",
    "STORED",
    "OverheadRun",
    "SideSpent",
    "measure_overhead",
    "summary",
]

PREFIX_OVERHEAD = "prefix-overhead"
"""The stored run's suite name (docs/results.md renders it)."""
STORED = Path("docs") / "results" / "slice-prefix-overhead.json"
"""Where ``benchmarks/overhead.py --against-prefix --store`` writes its run."""
AGENT_NAMES = ("sliding", "video", "web", "document")
SLIDING_CHUNKS, SLIDING_TOKENS, SLIDING_STEPS = 8, 64, 12
COUNTS = AgentCounts(
    video_frames=16,
    video_capacity=8,
    web_steps=10,
    document_pages=6,
    document_working=3,
    document_back_every=2,
)
"""The suite's agents at fewer steps (every op kind still happens): three alternating runs of all
four are affordable on a CPU, where each side's forward of a step takes seconds."""


@dataclass(frozen=True)
class SideSpent:
    """What one side spent over a run's timed steps.

    Attributes:
        ms: wall milliseconds (its ops and questions).
        forward_ms: the part of ``ms`` inside the model's forwards.
        tokens: tokens prefilled (questions included).
        forwards: the model's forwards.
    """

    ms: float
    forward_ms: float
    tokens: int
    forwards: int

    @property
    def rest_ms(self) -> float:
        """Wall outside the model's forwards: the side's own work."""
        return self.ms - self.forward_ms


@dataclass(frozen=True)
class OverheadRun:
    """One run of one agent on both sides; ``kamera_first``: which side ran first at step 0."""

    agent: str
    kamera_first: bool
    steps: int
    kamera: SideSpent
    prefix: SideSpent

    @property
    def wall_ratio(self) -> float:
        """kamera's wall over the prefix cache's (< 1: kamera is faster)."""
        return self.kamera.ms / self.prefix.ms


def scripts(backend: TransformersBackend, quick: bool, seed: int) -> dict[str, tuple[Script, int]]:
    """Each agent's script and how many of its leading steps run untimed."""
    vocab = (QUICK_SHAPE if quick else QWEN2_1_5B_SLICE).vocab
    tokens = QUICK_TOKENS if quick else REALISTIC_TOKENS
    counts = AgentCounts.quick() if quick else COUNTS
    chunks, frame = (4, 16) if quick else (SLIDING_CHUNKS, SLIDING_TOKENS)
    sliding = AGENTS["video"](
        RandomContents(backend.encoder, {**tokens, "frame": frame}, vocab, seed),
        replace(
            counts, video_frames=chunks + (4 if quick else SLIDING_STEPS), video_capacity=chunks, ask_every=1
        ),
    )
    contents = RandomContents(backend.encoder, tokens, vocab, seed)
    out = {"sliding": (replace(sliding, agent="sliding"), chunks)}
    out |= {name: (AGENTS[name](contents, counts), 0) for name in AGENT_NAMES[1:]}
    return out


def run_once(
    script: Script, backend: TransformersBackend, untimed: int, kamera_first: bool, agent: str
) -> OverheadRun:
    """``script`` on a fresh exact window and a fresh prefix cache, the side order alternating
    from step to step; the steps after the first ``untimed`` counted."""
    config = WindowConfig.exact(capacity_chunks=script.capacity, max_new_tokens=1)
    sides: dict[str, KameraSide | PrefixSide] = {
        "kamera": KameraSide(backend, config, script.chunks),
        "prefix": PrefixSide(backend, script.chunks),
    }
    clock = ForwardClock(backend)
    totals = {name: [0.0, 0.0, 0, 0] for name in sides}
    with clock.installed():
        for index, step in enumerate(script.steps):
            names = ["kamera", "prefix"] if (index % 2 == 0) == kamera_first else ["prefix", "kamera"]
            for name in names:
                clock.side, before = name, clock.spent[name]
                cost = sides[name].run(step).cost
                if index >= untimed:
                    spent = totals[name]
                    spent[0] += cost.ms
                    spent[1] += clock.spent[name] - before
                    spent[2] += cost.tokens
                    spent[3] += cost.forwards
    kamera, prefix = (SideSpent(t[0], t[1], int(t[2]), int(t[3])) for t in totals.values())
    return OverheadRun(agent, kamera_first, len(script.steps) - untimed, kamera, prefix)


def measure_overhead(
    agents: tuple[str, ...],
    runs: int,
    *,
    quick: bool = False,
    seed: int = 0,
    done: Callable[[], None] | None = None,
) -> list[OverheadRun]:
    """Every agent ``runs`` times on both sides (the first side alternating from run to run)."""
    backend = realistic_backend(QUICK_SHAPE if quick else QWEN2_1_5B_SLICE, seed)
    warm(backend)
    made = scripts(backend, quick, seed)
    out = []
    for number in range(runs):
        for agent in agents:
            script, untimed = made[agent]
            out.append(run_once(script, backend, untimed, number % 2 == 0, agent))
            if done is not None:
                done()
    return out


def summary(runs: list[OverheadRun]) -> dict[str, dict[str, Any]]:
    """Per agent: the median wall ratio over its runs, the tokens ratio, forwards and each side's
    rest per step (medians), and every run's figures."""
    out: dict[str, dict[str, Any]] = {}
    for agent in dict.fromkeys(run.agent for run in runs):
        mine = [run for run in runs if run.agent == agent]
        first = mine[0]
        out[agent] = {
            "steps": first.steps,
            "wall_ratio": statistics.median(run.wall_ratio for run in mine),
            "tokens_ratio": first.kamera.tokens / first.prefix.tokens,
            "tokens": {"kamera": first.kamera.tokens, "prefix": first.prefix.tokens},
            "forwards": {"kamera": first.kamera.forwards, "prefix": first.prefix.forwards},
            "rest_ms_per_step": {
                side: statistics.median(getattr(run, side).rest_ms / run.steps for run in mine)
                for side in ("kamera", "prefix")
            },
            "runs": [_run_json(run) for run in mine],
        }
    return out


def _run_json(run: OverheadRun) -> dict[str, Any]:
    return {
        "kamera_first": run.kamera_first,
        "wall_ratio": run.wall_ratio,
        "kamera": asdict(run.kamera),
        "prefix": asdict(run.prefix),
    }
