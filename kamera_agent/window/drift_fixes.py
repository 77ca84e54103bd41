"""Holding a window within its drift budget after an op: audits, then the cheapest fix that holds.

Why apart from the runner: the runner runs every op the same way; what an op left approximate
is this module's. After the op's plan ran (up to the chunks at the end it forms exactly over
their left, which the runner forms after the fixes: `WindowPlan.trailing_from`), each chunk the
window does not hold exactly is estimated left to right (`DriftBudget.estimates`, audits filed
with the op's writes), and the first chunk over ε gets the cheapest fix that can bring the
window within it:

1. **recompute** its most deviating tokens over the chunks to its left (`Executor.recompute`);
2. **re-prefill it alone** over its left (exact there) and keep the chunks after it where their
   audits, taken again, stay within ε: a kept chunk's drift falls with its distance from what
   changed, so on a real model the first survivor or two after a slide are over ε and the rest
   are not;
3. **re-prefill** from it to the end (each chunk then exact over its left).

Each of the first two is tried only where its failure, followed by the next fix, still costs no
more than the prefix cache's re-prefill of the op (`WindowPlan.prefix_bound`), and where the
budget expects it to pay at the share it has spent so far (`DriftBudget.worth_trying`).
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

from kamera_agent.backends.recompute import deviation_spent
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.core.kv_core import Txn
from kamera_agent.core.recompute import selected_count
from kamera_agent.critical_path import books
from kamera_agent.fidelity import DriftBudget, audit, audit_count
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store.audits import DriftAudit
from kamera_agent.window.answer_check import AnswerCheck
from kamera_agent.window.executor import Executor
from kamera_agent.window.plan import WindowPlan

if TYPE_CHECKING:
    from kamera_agent.window.runner import OpRunner

__all__ = ["RECOMPUTE", "REFILL_ONE", "DriftFixes"]

RECOMPUTE = "recompute"
"""The drift budget's outcome name for token recomputes (`DriftBudget.record`): how often one
left its chunk over ε."""
REFILL_ONE = "refill_one"
"""The drift budget's outcome name for re-prefilling one chunk over its left and keeping the
chunks after it: how often one of those was still over ε."""


class DriftFixes:
    """One op's audits and fixes, over the runner's state inside the op's transaction."""

    def __init__(
        self,
        runner: OpRunner,
        budget: DriftBudget,
        executor: Executor,
        txn: Txn,
        trailing: tuple[int, int] | None = None,
    ) -> None:
        """``trailing``: where the chunks the op forms after the fixes start
        (`WindowPlan.trailing_from`) and the most forming them prefills: they are not held here,
        and every fix leaves room for them within the prefix bound."""
        self.runner, self.budget, self.executor, self.txn = runner, budget, executor, txn
        self.state = runner.state
        self.end, self._after = (len(self.state.order), 0) if trailing is None else trailing
        core = runner.parts.core
        advances = (self.state.entries[ref].chunk.advance for ref in self.state.order)
        self.starts = list(accumulate(advances, initial=core.anchor.advance))
        self._placed: list[ChunkKV] = []
        self.estimates: list[float | None] = []

    def run(self, plan: WindowPlan) -> WindowPlan:
        """``plan`` with the fixes that held the window within ε added; the op's ``drift`` set."""
        if self.budget.units == "answer":
            return AnswerCheck(self).run(plan)
        budget, meter = self.budget, self.txn.meter
        first = self._estimate()
        audited, before = meter.counts["audits"] > 0, self.spent()
        if not audited and plan.declined:
            budget.declined(plan.op)
        recomputed: set[int] = set()
        while first is not None and first not in recomputed and self._recompute_pays(plan, first):
            self.executor.recompute(self.state.order[first], budget.calibration.recompute_share)
            recomputed.add(first)
            meter.add(drift_recomputes=1)
            still = self._estimate()
            budget.record(RECOMPUTE, float(still is not None and still <= first))
            first = still
        while first is not None and self._refill_one_pays(plan, first):
            why = f"{self._over(first)}; re-prefilled alone over its left"
            plan = self._fix(
                plan, self.runner.planner(self.txn.store).refill(self.state, first, why, first + 1)
            )
            meter.add(drift_fixes=1)
            still = self._estimate()
            budget.record(REFILL_ONE, float(still is not None))
            if still is not None and still <= first:
                break  # not within ε even re-prefilled over its left: re-prefilled from there below
            first = still
        if first is not None:
            plan = self._refill(plan, first)
        if audited:  # what share of the bound the fixes spent: whether such ops are worth trying
            spent = self.spent() - before
            budget.record(plan.op, spent / plan.fix_bound if plan.fix_bound else float(spent > 0))
        meter.drift = max((e for e in self.estimates if e is not None), default=0.0)
        return plan

    def _estimate(self) -> int | None:
        """Estimate the window as it is now, auditing what no audit covers; the first chunk over ε."""
        self._placed.clear()  # placed afresh: a fix may have changed a chunk's KV
        self.estimates = self.runner.drift(self._measure, True, self.txn.store, self.end)
        return self.budget.first_over(self.estimates)

    def _measure(self, i: int, chunk_state: ChunkState, ctx: Context) -> float:
        if not self._placed:
            self._placed.extend(self.executor.placements(self.end))
        chunk = self.state.entries[self.state.order[i]].chunk
        seed, share, placed = (
            f"{chunk_state.digest}:{ctx.digest}",
            self.budget.calibration.audit_share,
            self._placed,
        )
        core, txn = self.runner.parts.core, self.txn
        with books("the drift budget compares the audited error with its epsilon"):
            error, tokens = audit(
                core, chunk, placed[i + 1], placed[: i + 1], self.starts[i], share, seed, txn
            )
        txn.meter.add(audits=1)
        txn.meter.add(audit_tokens=tokens)
        # filed with the op's writes: readers of the store (other windows, engines) use it too
        txn.store.put_audit(DriftAudit(chunk.key, chunk_state.digest, ctx.digest, error, tokens))
        return error

    def _over(self, first: int) -> str:
        return f"drift budget {self.budget.epsilon:g}: estimated {self.estimates[first]:.3g} here"

    def _fix(self, plan: WindowPlan, fix: WindowPlan) -> WindowPlan:
        self.executor.run(fix)
        return plan.changed(steps=plan.steps + fix.steps)

    def _refill(self, plan: WindowPlan, first: int) -> WindowPlan:
        return self.refill_from(plan, first, f"{self._over(first)}; re-prefilled from it")

    def refill_from(self, plan: WindowPlan, first: int, why: str) -> WindowPlan:
        """Re-prefill from ``first`` (or from where the plan was bounded, if that is cheaper) to
        the op's trailing content."""
        planner = self.runner.planner(self.txn.store)
        fix = planner.refill(self.state, first, why, self.end)
        vouched = plan.vouched_to
        if vouched is not None and vouched < first:  # what the plan was bounded with, if cheaper
            earlier = planner.refill(self.state, vouched, why, self.end)
            if _tokens(earlier) < _tokens(fix):
                fix, first = earlier, vouched
        plan = self._fix(plan, fix)
        self.txn.meter.add(drift_fixes=self.end - first)
        self.estimates = self.runner.drift(store=self.txn.store, end=self.end)
        return plan

    def spent(self) -> int:
        """What the op has prefilled so far, its audits apart."""
        return self.txn.meter.spent.tokens_prefilled - self.txn.meter.counts["audit_tokens"]

    def _audits_from(self, start: int) -> int:
        share = self.budget.calibration.audit_share
        refs = self.state.order[start : self.end]
        return sum(audit_count(self.state.entries[ref].chunk.num_tokens, share) for ref in refs)

    def _recompute_pays(self, plan: WindowPlan, first: int) -> bool:
        """Whether to recompute the most deviating tokens of the chunk at ``first`` before
        re-prefilling it and everything after it (never costlier, expected to pay)."""
        budget, entry = self.budget, self.state.entries[self.state.order[first]]
        if plan.prefix_bound is None or entry.state.kind == "recomputed":
            return False
        n, layers = entry.chunk.num_tokens, self.runner.parts.core.backend.layout.num_layers
        probe = deviation_spent(n, 1, layers).tokens_prefilled
        cost = selected_count(budget.calibration.recompute_share, n) + probe  # with its picking probe
        if cost >= n:
            return False  # as dear as re-prefilling the chunk itself
        fix = _tokens(self.runner.planner(self.txn.store).refill(self.state, first, "fix", self.end))
        if self.spent() + cost + fix + self._after > plan.prefix_bound:
            return False
        if budget.worth_trying(RECOMPUTE, cost, fix, fix, self._audits_from(first)):
            return True
        budget.declined(RECOMPUTE)
        return False

    def _refill_one_pays(self, plan: WindowPlan, first: int) -> bool:
        """Whether to re-prefill only the chunk at ``first`` over its left and audit the chunks
        after it again, before re-prefilling from ``first`` to the end (never costlier, expected
        to pay)."""
        if plan.prefix_bound is None or first + 1 >= self.end:
            return False
        planner = self.runner.planner(self.txn.store)
        cost = _tokens(planner.refill(self.state, first, "fix", first + 1))
        rest = _tokens(planner.refill(self.state, first + 1, "fix", self.end))
        if self.spent() + cost + rest + self._after > plan.prefix_bound:
            return False
        if self.budget.worth_trying(REFILL_ONE, cost, rest, cost + rest, self._audits_from(first + 1)):
            return True
        self.budget.declined(REFILL_ONE)
        return False


def _tokens(plan: WindowPlan) -> int:
    return sum(step.tokens for step in plan.steps)
