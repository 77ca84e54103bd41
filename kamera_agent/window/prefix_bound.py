"""Never costlier than a prefix cache: a plan, or re-prefilling from the first slot it changes.

Why apart from the per-op planning (`kamera_agent.window.planner`): the planner says what each
chunk needs for an op; this bound compares the whole plan with what a prefix cache would pay
(every token from the first changed slot on) and, with a drift budget, with the most its fixes
could add, and runs the cheaper. The same re-prefill steps are how a drift budget is kept
(`PrefixBound.refill`).
"""

from __future__ import annotations

from dataclasses import replace

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.fidelity import audit_count
from kamera_agent.window.plan import Step, WindowPlan, canonical_leads_run
from kamera_agent.window.rules import PlanInputs, Rules
from kamera_agent.window.state import ChunkRef, WindowRecord

__all__ = ["PrefixBound"]


class PrefixBound:
    """Bounds plans by re-prefilling and plans the re-prefills (pure: it reads, never runs)."""

    def __init__(self, inputs: PlanInputs, rules: Rules) -> None:
        self.inputs, self.rules, self.root = inputs, rules, inputs.root

    def bounded(self, state: WindowRecord, plan: WindowPlan) -> WindowPlan:
        """`cheaper` of ``plan`` and re-prefilling, its forwards counted as the executor runs them."""
        return _lead_shares_forward(self.cheaper(state, plan))

    def cheaper(self, state: WindowRecord, plan: WindowPlan) -> WindowPlan:
        """``plan``, or re-prefilling from the first slot it changes where that prefills fewer tokens.

        Why: a prefix cache pays exactly the tokens from the first changed slot on (`_first_changed`:
        by content, whatever the plan does left of it); a plan can pay more (a recall formed over
        its original context rebuilds that context, a reorder's canonicals, a cascade of
        re-formed survivors). Both are counted the same way (the planned steps' tokens), and the
        cheaper runs: the re-prefill forms every chunk from that slot exactly over the chunks
        left of it as the plan has them, so it never costs fidelity the plan would not. With a
        drift budget the plan is counted with the most keeping the budget could add after it
        (`_budget_fix_tokens`), and a chunk left of that slot that it knows to be over ε, or that
        the plan changes (or changes the left of) and it cannot vouch for, moves the slot to it;
        one the window holds as it was, not audited since, is the budget's to audit and fix after
        the op.
        """
        planned = sum(step.tokens for step in plan.steps)
        budget = self.inputs.budget
        if planned == 0 and budget is None:
            return plan
        changed = _first_changed(state, plan)
        first, over = (None, False) if budget is None else self._first_unvouched(state, plan)
        if first is not None and first < changed and (over or _first_set_anew(state, plan) <= first):
            changed = first  # re-prefilling keeps no chunk the budget would fix
        order = plan.order
        index_of = {ref: i for i, ref in enumerate(order)}
        left = [step for step in plan.steps if index_of[step.ref] < changed]
        ctx = self.root
        for step in left:
            if step.kind != "form_canonical":
                ctx = ctx.extend(step.state)
        after = sum(step.tokens for step in self._refill_steps(state, plan, changed, ctx, "costed"))
        refill = sum(step.tokens for step in left) + after

        def refilling(why: str, declined: bool = False) -> WindowPlan:
            # planned again with its reason: planning reads no tensor, and a plan is a few steps a chunk
            steps = (*left, *self._refill_steps(state, plan, changed, ctx, why))
            return plan.changed(steps=steps, declined=declined, prefix_bound=refill)

        if budget is None:
            if refill >= planned:
                return plan
            return refilling(f"re-prefill from slot {changed}: fewer tokens than the plan's {planned}")
        trailing = _trailing_from(plan, first)
        fix, audits = self._budget_fix_tokens(state, plan, first, trailing, (changed, after))
        if planned + fix > refill:
            return refilling(
                f"re-prefill from slot {changed}: the plan and what its drift budget may add cost more"
            )
        if fix and not budget.worth_trying(plan.op, planned, fix, refill, audits):
            why = f"re-prefill from slot {changed}: the drift budget expects to fix what the plan keeps"
            return refilling(why, declined=True)
        return plan.changed(vouched_to=first, prefix_bound=refill, fix_bound=fix, trailing_from=trailing)

    def refill(self, state: WindowRecord, start: int, why: str, end: int | None = None) -> WindowPlan:
        """Re-prefill the window's chunks from index ``start`` on (to ``end``, else to the last)
        over the chunks left of it as they are (each then exact over its left context): how a
        drift budget is kept."""
        order = tuple(state.order)
        ctx = self.root
        for ref in order[:start]:
            ctx = ctx.extend(state.entries[ref].state)
        plan = WindowPlan("refill", order)
        return _lead_shares_forward(
            plan.changed(steps=tuple(self._refill_steps(state, plan, start, ctx, why, end)))
        )

    def _refill_steps(
        self,
        state: WindowRecord,
        plan: WindowPlan,
        start: int,
        ctx: Context,
        why: str,
        end: int | None = None,
    ) -> list[Step]:
        """The steps re-prefilling ``plan.order`` from ``start`` (to ``end``) over ``ctx``
        (formations share forwards)."""
        steps: list[Step] = []
        previous: Step | None = None
        group: list[Step] = []
        order = plan.order
        for i in range(start, len(order) if end is None else end):
            ref = order[i]
            chunk = plan.chunks[ref] if ref in plan.chunks else state.entries[ref].chunk
            step = self.rules.refilled(ref, chunk, ctx, order[:i], why)
            step = self.rules.across_gap(self.rules.in_run(step, previous), group)
            if step.kind == "form_patch":
                group = [*group, step] if step.in_run else [step]
            if step.needs_canonical:
                steps.append(self.rules.form_canonical(ref, chunk))
            steps.append(step)
            previous, ctx = step, ctx.extend(step.state)
        return steps

    def _first_unvouched(self, state: WindowRecord, plan: WindowPlan) -> tuple[int | None, bool]:
        """The first chunk whose planned state the drift budget cannot vouch for yet (not
        remembered, or over ε; ``None``: every planned chunk is known to be within ε), and
        whether it is known to be over ε."""
        budget = self.inputs.budget
        assert budget is not None
        estimates = budget.estimates(_planned_states(state, plan), self.root)
        first = budget.first_over(estimates)
        return first, first is not None and estimates[first] is not None

    def _budget_fix_tokens(
        self,
        state: WindowRecord,
        plan: WindowPlan,
        first: int | None,
        end: int | None,
        known: tuple[int, int],
    ) -> tuple[int, int]:
        """The most the drift budget could re-prefill after ``plan`` runs, from ``first``
        (`_first_unvouched`) to ``end`` (the plan's trailing formations, which the runner forms
        after the fixes: `_trailing_from`), else to the right end, and the tokens its audits would
        recompute at most. (Audits are the estimator's cost, counted apart in ``audit_tokens``:
        they recompute a sample, they prefill no chunk.) ``known``: a slot and what re-prefilling
        from it to the end over the plan's states to its left costs, when already planned."""
        budget = self.inputs.budget
        assert budget is not None
        if first is None:
            return 0, 0
        if first == known[0] and end is None:
            fix = known[1]
        else:
            ctx = self.root
            for planned in _planned_states(state, plan)[:first]:
                ctx = ctx.extend(planned)
            fix = sum(step.tokens for step in self._refill_steps(state, plan, first, ctx, "fix", end))
        if end is not None:  # a fix changes their left: formed then, whatever the store held for the plan
            formed = {ref: _chunk(state, plan, ref).num_tokens for ref in plan.order[end:]}
            fix += sum(formed.values()) - sum(step.tokens for step in plan.steps if step.ref in formed)
        share = budget.calibration.audit_share
        audited = [_chunk(state, plan, ref) for ref in plan.order[first:end]]
        audits = sum(audit_count(c.num_tokens, share) for c in audited)
        return fix, audits


def _lead_shares_forward(plan: WindowPlan) -> WindowPlan:
    """``plan`` with the formation of its second chunk counted in the forward that forms the
    first chunk's canonical, where the executor runs them as one (`canonical_leads_run`)."""
    steps = plan.steps
    for i in range(len(steps) - 2):
        first = steps[i + 2]
        if first.forwards and canonical_leads_run(steps, i, plan.order):
            detail = f"{first.detail} (in the forward of the chunk before it)"
            joined = replace(first, forwards=0, detail=detail)
            return plan.changed(steps=(*steps[: i + 2], joined, *steps[i + 3 :]))
    return plan


def _chunk(state: WindowRecord, plan: WindowPlan, ref: ChunkRef) -> Chunk:
    return plan.chunks[ref] if ref in plan.chunks else state.entries[ref].chunk


def _trailing_from(plan: WindowPlan, first: int | None) -> int | None:
    """The first of the chunks at the end of ``plan.order`` that the plan sets to their exact KV
    over their left as planned (formed in the window, or served so from the store), where a chunk
    the budget cannot vouch for (``first``) stands left of them; ``None`` where there is none.

    Why: those chunks' own drift is nil whatever their left holds (`DriftBudget.own`), and formed
    after the budget's fixes they are formed once, over what stands; formed before, a fix to their
    left would re-form them, and counting that twice ruled out every op that brings new content
    behind an approximation (a slide that pushes, an agent's turn that drops an old screen)."""
    if first is None:
        return None
    final = {step.ref: step for step in plan.steps if step.kind != "form_canonical"}
    start = len(plan.order)
    while start > first + 1 and _exact_over_left(final.get(plan.order[start - 1])):
        start -= 1
    while start < len(plan.order) and final[plan.order[start]].in_run:
        start += 1  # it shares the forward of a chunk left of it (and is formed over its exact KV)
    return start if start < len(plan.order) and start >= 2 else None


def _exact_over_left(step: Step | None) -> bool:
    """``step`` gives its chunk the exact KV over the chunks planned to its left."""
    if step is None or step.off_window or step.kind not in ("form_patch", "apply_patch"):
        return False
    return step.state.kind == "patched" and step.state.rank == "full"


def _planned_states(state: WindowRecord, plan: WindowPlan) -> list[ChunkState]:
    """Each chunk's state once ``plan`` has run, left to right."""
    final = {step.ref: step.state for step in plan.steps if step.kind != "form_canonical"}
    return [final[ref] if ref in final else state.entries[ref].state for ref in plan.order]


def _first_set_anew(state: WindowRecord, plan: WindowPlan) -> int:
    """The first slot whose state ``plan`` sets anew (or where the window had no chunk)."""
    planned = _planned_states(state, plan)
    for i, ref in enumerate(state.order[: len(planned)]):
        if planned[i] != state.entries[ref].state:
            return i
    return min(len(state.order), len(planned))


def _first_changed(state: WindowRecord, plan: WindowPlan) -> int:
    """The first slot a prefix cache re-prefills from for ``plan``'s op: the first whose content
    differs (another chunk there, so every chunk after it moved too), or whose chunk the window
    has not formed yet (a pending one: its KV is not in the cache).

    Why content, not the states the plan sets: a plan that chose to re-form a chunk the op left
    alone would otherwise move its own yardstick left, and be let through at the cost of
    re-prefilling from there (a recall behind survivors that absorbed it once re-formed them all
    at many times a prefix cache's cost)."""
    for i, ref in enumerate(plan.order):
        if i >= len(state.order):
            return i
        old = state.order[i]
        if old.key != ref.key or state.entries[old].pending:
            return i
    return len(plan.order)
