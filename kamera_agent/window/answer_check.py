"""Holding a window within a drift budget in answer units after an op (`WindowConfig.answer_budget`).

Why apart from `drift_fixes`: the budget in KV units audits each approximated chunk and fixes
the first over ε; this one judges the window by its answer (`kamera_agent.fidelity.answer`). From
the first approximated chunk no verdict covers yet (an op's change, or a chunk whose left changed)
to where the op's trailing content starts, every approximated chunk gets its first rows
recomputed over its left as it then stands, and they stay (a repair). The probe is decoded over
the window before and after; the estimate of what the rest owes, added to what the verdicts
before it let stand, either stands or the window is re-prefilled from that first chunk, which
makes everything from there exact over its left.

The rows recomputed and the probe's decodes are the estimator's cost, counted in
``audit_tokens`` (the never-costlier rule counts them apart, as it does the KV audits); where a
verdict stands, the rows stay in the window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.core.recompute import selected_count
from kamera_agent.fidelity import ANSWER_SHARE, combined, estimate_answer, room, spread
from kamera_agent.window.plan import WindowPlan

if TYPE_CHECKING:
    from kamera_agent.window.drift_fixes import DriftFixes

__all__ = ["AnswerCheck", "neutral_probe"]

_LEAST = 1e-30
"""The least estimate a verdict files: 0 is what the window holds exactly."""


def neutral_probe(query_ids: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The probe an answer budget decodes: an empty question as the window frames questions (the
    end of a user turn and the assistant's opening), or, where the model frames none, a newline
    (what plain text goes on from)."""
    ids = query_ids("")
    return ids if ids.numel() else query_ids("\n")


class AnswerCheck:
    """One op's verdict in answer units, over a `DriftFixes`' state, executor and transaction."""

    def __init__(self, fixes: DriftFixes) -> None:
        self.fixes = fixes
        self.state, self.budget, self.meter = fixes.state, fixes.budget, fixes.txn.meter

    def run(self, plan: WindowPlan) -> WindowPlan:
        """``plan``, re-prefilled from the first chunk judged where the verdict did not stand;
        the op's ``drift`` set to the window's estimated answer KL."""
        first, earlier = self._first_unjudged()
        if first is None:
            self.meter.drift = earlier
            return plan
        left = room(self.budget.epsilon, earlier)
        if self.budget.hopeless(plan.op, left):  # no estimate measured so far would fit
            why = f"the verdicts before leave KL {left:.3g}, under the least an op of its kind measured"
            return self._refill(plan, first, earlier, f"{why} ({self.budget.least(plan.op):.3g})")
        judged = self._approximated(first)
        probe = neutral_probe(self.fixes.runner.parts.query_ids)
        before = self._probe(probe)
        rows = 0
        for i in judged:
            ref = self.state.order[i]
            self.fixes.executor.recompute(ref, ANSWER_SHARE, head=True)
            rows += selected_count(ANSWER_SHARE, self.state.entries[ref].chunk.num_tokens)
        after = self._probe(probe)
        tokens = [self.state.entries[self.state.order[i]].chunk.num_tokens for i in judged]
        estimate = estimate_answer(before, after, sum(tokens) / rows)
        self.budget.measured(plan.op, estimate.kl)
        kl = combined(earlier, estimate.kl)
        self.meter.add(audits=len(judged), audit_tokens=rows + 2 * int(probe.numel()))
        if estimate.same_top and kl <= self.budget.epsilon:
            self._remember(dict(zip(judged, spread(estimate.kl, tokens), strict=True)))
            self.budget.record(plan.op, 0.0)
            self.meter.drift = kl
            return plan
        return self._refill(plan, first, earlier, self._why(estimate.kl, estimate.same_top))

    def _refill(self, plan: WindowPlan, first: int, earlier: float, why: str) -> WindowPlan:
        before_fix = self.fixes.spent()
        plan = self.fixes.refill_from(plan, first, f"answer budget {self.budget.epsilon:g}: {why}")
        spent = self.fixes.spent() - before_fix
        self.budget.record(plan.op, spent / plan.fix_bound if plan.fix_bound else 1.0)
        self.meter.drift = earlier
        return plan

    def _chain(self) -> list[tuple[int, ChunkState, Context]]:
        """Each chunk up to the op's trailing content that the window holds approximately: its
        index, state and left context."""
        out = []
        ctx = self.fixes.runner.parts.core.root
        for i, ref in enumerate(self.state.order[: self.fixes.end]):
            chunk_state = self.state.entries[ref].state
            following = ctx.extend(chunk_state)
            if not following.exact:
                out.append((i, chunk_state, ctx))
            ctx = following
        return out

    def _first_unjudged(self) -> tuple[int | None, float]:
        """The first approximated chunk no verdict covers, and the largest estimate of the chunks
        left of it (what the verdicts before let stand)."""
        fixes = self.fixes
        states = [self.state.entries[ref].state for ref in self.state.order[: fixes.end]]
        estimates = self.budget.estimates(states, fixes.runner.parts.core.root)
        first = next((i for i, e in enumerate(estimates) if e is None), None)
        earlier = max((e for e in estimates[:first] if e is not None), default=0.0)
        return first, earlier

    def _approximated(self, first: int) -> list[int]:
        """The chunks from ``first`` on that no verdict covers and that were not formed over
        exactly their left (those add nothing themselves, and their rows are exact already)."""
        return [i for i, st, ctx in self._chain() if i >= first and self.budget.own(st, ctx) is None]

    def _remember(self, shares: dict[int, float]) -> None:
        """File each judged chunk's share of the verdict (`spread`) under its state behind its
        left, as they now are: chained left to right they give the verdict back. The chunks among
        them formed over exactly their left before the repair changed it add nothing themselves:
        the least estimate, never 0, which would say the window holds them exactly."""
        for i, chunk_state, ctx in self._chain():
            if i >= min(shares):
                self.budget.remember(chunk_state, ctx, max(shares.get(i, 0.0), _LEAST))

    def _probe(self, probe: torch.Tensor) -> torch.Tensor:
        """The probe's next-token logits over the window up to the op's trailing content, on the
        retained engine cache (only what changed since it was built is placed again)."""
        fixes = self.fixes
        return fixes.executor.answer(probe, DecodeConfig(max_new_tokens=1), fixes.end).first_logits

    def _why(self, kl: float, same_top: bool) -> str:
        said = f"the rest estimated at KL {kl:.3g}"
        return f"{said}{'' if same_top else ', its first token changed'}; re-prefilled from it"
