"""What a budget in answer units remembers of its verdicts (`DriftBudget.measured`, `hopeless`)."""

from __future__ import annotations

from kamera_agent.fidelity import ANSWER_SHARE, Calibration, DriftBudget


def _budget() -> DriftBudget:
    return DriftBudget(0.1, Calibration("fp", scale=1.0, inherit=0.0, audit_share=ANSWER_SHARE), "answer")


def test_a_verdict_is_hopeless_only_under_the_least_estimate_measured_and_is_retried() -> None:
    budget = _budget()
    assert budget.least("slide") == 0.0 and not budget.hopeless("slide", 0.0)  # nothing measured yet
    budget.measured("evict", 0.05)  # an eviction counts as a slide
    budget.measured("slide", 0.2)
    assert budget.least("slide") == 0.05 and budget.least("recall") == 0.0
    assert not budget.hopeless("slide", 0.04)  # two verdicts do not forecast a third
    budget.measured("slide", 0.3)
    budget.measured("slide", 0.4)
    assert not budget.hopeless("slide", 0.05) and not budget.hopeless("recall", 0.01)
    verdicts = [budget.hopeless("slide", 0.04) for _ in range(32)]
    assert verdicts.count(False) == 2 and not verdicts[15] and not verdicts[31]  # every 16th measured
