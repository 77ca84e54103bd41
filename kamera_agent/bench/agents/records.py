"""What the agents suite measured: per agent × model, every step of every side, and the checks.

Why records per step and per op: totals say who wins, the records say where the time goes (a
push, a reorder's re-formed patches, a question) and feed the plots; results.json holds them
all, so any figure in the report can be recomputed from the file.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kamera_agent.bench.agents.script import Script
from kamera_agent.bench.agents.scripts import AgentCounts
from kamera_agent.bench.agents.sides import OpSpent, SideCost
from kamera_agent.bench.agents.ttft import TTFTRun
from kamera_agent.bench.common import finite, p90
from kamera_agent.models.random_qwen2 import Qwen2Shape

__all__ = [
    "PREFIX",
    "RECOMPUTE_SIDES",
    "SIDES",
    "TEXT_SIDES",
    "UNBOUNDED",
    "AgentRun",
    "AgentsRun",
    "AskRecord",
    "StepRecord",
]

PREFIX = "prefix"
SIDES: tuple[str, ...] = ("kamera", "kamera-exact", PREFIX)
"""The sides every agent runs on: kamera at its defaults, under `WindowConfig.exact`, the prefix cache."""
UNBOUNDED = "kamera-unbounded"
"""The side a real text model's agents also run on: the defaults' policies with no drift budget,
what their approximations save and cost when nothing bounds them (labelled so in every table)."""
RECOMPUTE_SIDES = {"recompute 5%": 0.05, "recompute 15%": 0.15, "recompute 30%": 0.30}
"""Token recompute (CacheBlend's way, `kamera_agent.bench.blend_cache.BlendCache`) at these shares
of every chunk after the first change: the other way to restore what reuse loses, set beside
kamera on a real text model's agents."""
TEXT_SIDES: tuple[str, ...] = ("kamera", "kamera-exact", UNBOUNDED, *RECOMPUTE_SIDES, PREFIX)
"""The sides a real text model's agents run on."""


@dataclass(frozen=True)
class StepRecord:
    """One step of the script and what each side spent on it.

    Attributes:
        index: the step's place in the script.
        kind: what the agent did ("push", "frame", "replace+append", "read", "go back" ...).
        detail: which chunks, in words.
        chunks: chunks in the window after the step.
        window_tokens: cache slots those chunks take.
        asked: the step ended with a question.
        sides: side -> its cost for the step.
        ops: side -> its cost op by op (window ops and the question; the prefix cache's sync).
    """

    index: int
    kind: str
    detail: str
    chunks: int
    window_tokens: int
    asked: bool
    sides: Mapping[str, SideCost]
    ops: Mapping[str, tuple[OpSpent, ...]]


@dataclass(frozen=True)
class AskRecord:
    """The check after one step: each kamera side's first answer token against the reference.

    Attributes:
        step: the step it followed.
        query: the question, then the answer's opening (the step's own; after a step that asks
            none, the last one asked, or the script's first before any, answered outside every
            clock).
        reference: ``"re-prefill"`` (the model's own forward over the window: demo model) or
            ``"prefix"`` (the prefix cache's logits, themselves a re-prefill: the realistic shape,
            where a second full re-prefill per question would cost as much as the baseline).
        top1: side -> its first answer token is the reference's.
        kl: side -> next-token KL(reference ‖ side).
        baseline_error: max |logit difference| of the prefix cache to the model's own forward
            (NaN where the reference is the prefix cache itself).
    """

    step: int
    query: str
    reference: str
    top1: Mapping[str, bool]
    kl: Mapping[str, float]
    baseline_error: float = math.nan
    asked: bool = True
    """The step asked this question (its answer timed); else the check's own, untimed."""


@dataclass
class AgentRun:
    """One agent on one model: set up before its first step, filled as it runs.

    Attributes:
        checks: one per step, after it: every side's first answer token against the reference.
        baseline_logit_error: at the end, max |logit difference| between the prefix cache and
            the model's own re-prefill of the final window (should be ~1e-5: it is exact).
        final_kl: side -> next-token KL of its answer over the final window to that re-prefill.
    """

    agent: str
    model: str
    summary: str
    capacity: int | None
    sizes: dict[str, str]
    steps_requested: int
    asks_requested: int
    sides: tuple[str, ...] = SIDES
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: list[StepRecord] = field(default_factory=list)
    checks: list[AskRecord] = field(default_factory=list)
    baseline_logit_error: float = math.nan
    final_kl: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @classmethod
    def of(cls, script: Script, model: str, sides: tuple[str, ...] = SIDES) -> AgentRun:
        return cls(
            script.agent,
            model,
            script.summary,
            script.capacity,
            script.sizes,
            len(script.steps),
            script.asks,
            sides,
        )

    @property
    def asks(self) -> list[AskRecord]:
        """The checks of the steps that asked (the script's own questions)."""
        return [check for check in self.checks if check.asked]

    @property
    def complete(self) -> bool:
        return len(self.records) == self.steps_requested

    def total(self, side: str, name: str) -> float:
        """A side's sum of one `SideCost` field over the steps done."""
        return float(
            sum(getattr(record.sides[side], name) for record in self.records if side in record.sides)
        )

    def ratio(self, name: str, side: str) -> float:
        """The prefix cache's total over ``side``'s: how many times less ``side`` spent (NaN at 0)."""
        ours, theirs = self.total(side, name), self.total(PREFIX, name)
        return theirs / ours if ours > 0 and theirs > 0 else math.nan

    def cumulative(self, side: str, name: str) -> list[float]:
        running, out = 0.0, []
        for record in self.records:
            running += getattr(record.sides[side], name)
            out.append(running)
        return out

    def op_ms(self, side: str) -> dict[str, float]:
        """A side's wall milliseconds by op kind (push, evict, reorder, recall, sync, ask)."""
        return self._by_op(side, "ms")

    def op_tokens(self, side: str) -> dict[str, float]:
        """A side's tokens prefilled by op kind (push, evict, reorder, recall, sync, ask)."""
        return self._by_op(side, "tokens")

    def _by_op(self, side: str, name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for record in self.records:
            for op in record.ops.get(side, ()):
                out[op.op] = out.get(op.op, 0.0) + getattr(op, name)
        return out

    def agreement(self, side: str) -> float:
        """Share of steps after which the side's first answer token is the reference's."""
        votes = [check.top1[side] for check in self.checks if side in check.top1]
        return sum(votes) / len(votes) if votes else math.nan

    def kl(self, side: str) -> tuple[float, float, float]:
        """(mean, 90th percentile, max) next-token KL to the reference after every step."""
        values = [check.kl[side] for check in self.checks if side in check.kl]
        if not values:
            return math.nan, math.nan, math.nan
        return statistics.fmean(values), p90(values), max(values)

    def by_kind(self, side: str) -> dict[str, dict[str, Any]]:
        """Per step kind (what the agent did: "push", "frame", "replace+append", "go back" ...):
        steps, ``side``'s tokens prefilled and wall ms over them, and (a kamera side) the share
        of the checks after them whose first token is the reference's, and their mean KL."""
        kinds = {record.index: record.kind for record in self.records}
        out: dict[str, dict[str, Any]] = {}
        for record in self.records:
            entry = out.setdefault(record.kind, {"steps": 0, "tokens": 0, "ms": 0.0})
            entry["steps"] += 1
            entry["tokens"] += record.sides[side].tokens if side in record.sides else 0
            entry["ms"] += record.sides[side].ms if side in record.sides else 0.0
        if side == PREFIX:
            return out
        for kind, entry in out.items():
            checks = [c for c in self.checks if kinds.get(c.step) == kind and side in c.top1]
            entry["checks"] = len(checks)
            entry["agreement"] = finite(sum(c.top1[side] for c in checks) / len(checks)) if checks else None
            entry["kl_mean"] = finite(statistics.fmean(c.kl[side] for c in checks)) if checks else None
        return out

    def max_baseline_error(self) -> float:
        """The prefix cache's largest |logit difference| to the model's own forward, over every
        check made (after every step on the demo model, the final window on both)."""
        errors = [check.baseline_error for check in self.checks] + [self.baseline_logit_error]
        finite_errors = [error for error in errors if math.isfinite(error)]
        return max(finite_errors) if finite_errors else math.nan

    def to_json(self) -> dict[str, Any]:
        keys = ("ms", "tokens", "forwards", "vision", "ask_ms")
        sides = {}
        for side in self.sides:
            totals: dict[str, Any] = {key: self.total(side, key) for key in keys}
            totals["by_op_ms"] = self.op_ms(side)
            totals["by_op_tokens"] = self.op_tokens(side)
            entry: dict[str, Any] = {"settings": self.settings.get(side, {}), "totals": totals}
            entry["by_kind"] = self.by_kind(side)
            if side != PREFIX:
                entry["ratios"] = {key: finite(self.ratio(key, side)) for key in ("ms", "tokens", "forwards")}
                mean, high, worst = self.kl(side)
                entry["fidelity"] = {
                    "checks": sum(side in check.top1 for check in self.checks),
                    "asks": sum(side in ask.top1 for ask in self.asks),
                    "agreement": finite(self.agreement(side)),
                    "kl_mean": finite(mean),
                    "kl_p90": finite(high),
                    "kl_max": finite(worst),
                    "final_kl": finite(self.final_kl.get(side, math.nan)),
                }
            sides[side] = entry
        return {
            "agent": self.agent,
            "model": self.model,
            "summary": self.summary,
            "capacity_chunks": self.capacity,
            "tokens_per_chunk": self.sizes,
            "steps_requested": self.steps_requested,
            "steps_done": len(self.records),
            "asks_requested": self.asks_requested,
            "seconds": self.seconds,
            "baseline_logit_error": finite(self.baseline_logit_error),
            "baseline_max_error": finite(self.max_baseline_error()),
            "sides": sides,
            "records": [_record_json(record) for record in self.records],
            "checks": [
                {**asdict(check), "baseline_error": finite(check.baseline_error)} for check in self.checks
            ],
        }


def _record_json(record: StepRecord) -> dict[str, Any]:
    return {
        "index": record.index,
        "kind": record.kind,
        "detail": record.detail,
        "chunks": record.chunks,
        "window_tokens": record.window_tokens,
        "asked": record.asked,
        "sides": {side: asdict(cost) for side, cost in record.sides.items()},
        "ops": {side: [asdict(op) for op in ops] for side, ops in record.ops.items()},
    }


@dataclass
class AgentsRun:
    """The suite's live state: its sizes, then an `AgentRun` per agent × model as each starts.

    Attributes:
        quick: smoke sizes (a tiny model shape too): timings say nothing about the targets.
        shape: the realistic model's shape (random init, float32, text-only); ``None`` on a real
            text model, where the agents run on that model alone.
        tokens: tokens per chunk of each content kind on the realistic shape.
        text_lengths: on a real text model, each content kind's token range
            (`kamera_agent.bench.agents.text_contents`).
        content: what the chunks are, in words.
    """

    quick: bool
    threads: int
    shape: Qwen2Shape | None
    demo_model: str
    counts: AgentCounts
    tokens: Mapping[str, int]
    agents: tuple[str, ...]
    text_lengths: Mapping[str, tuple[int, int]] | None = None
    content: str = "the demo task's frames and pages (demo); random-token chunks (realistic shape)"
    runs: list[AgentRun] = field(default_factory=list)
    ttft: TTFTRun | None = None
    """Time to first token after window ops against its floor (`kamera_agent.bench.agents.ttft`)."""

    def find(self, agent: str, model: str) -> AgentRun | None:
        return next((r for r in self.runs if r.agent == agent and r.model == model), None)

    def of_agent(self, agent: str) -> list[AgentRun]:
        """``agent``'s runs, one per model, in the order they ran."""
        return [run for run in self.runs if run.agent == agent]

    def to_json(self) -> dict[str, Any]:
        lengths = None if self.text_lengths is None else {k: list(v) for k, v in self.text_lengths.items()}
        return {
            "quick": self.quick,
            "threads": self.threads,
            "realistic_shape": None if self.shape is None else asdict(self.shape),
            "demo_model": self.demo_model,
            "content": self.content,
            "counts": asdict(self.counts),
            "realistic_tokens_per_chunk": dict(self.tokens),
            "text_lengths": lengths,
            "agents": list(self.agents),
            "runs": [run.to_json() for run in self.runs],
            "ttft": self.ttft.to_json() if self.ttft is not None else None,
        }
