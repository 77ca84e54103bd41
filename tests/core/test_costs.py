"""`CostMeter` mirrors `OpCost`: the meter counts by the same names the frozen result holds, so a
field added to one and not the other would stay zero in every op's cost without a word."""

from __future__ import annotations

from dataclasses import fields

from kamera_agent.core.costs import CostMeter
from kamera_agent.results import OpCost

FROM_SPENT = {"forwards", "tokens_prefilled", "vision_encodes"}
"""What the meter takes from the primitives' reports rather than counting itself."""


def test_every_op_cost_field_is_counted_by_the_meter_or_reported() -> None:
    counted = {f.name for f in fields(CostMeter)} & {f.name for f in fields(OpCost)}
    assert {f.name for f in fields(OpCost)} == counted | FROM_SPENT | {"seconds"}


def test_what_the_meter_counts_reaches_the_cost_by_name() -> None:
    meter = CostMeter(reforms=2, audit_tokens=7, drift=0.25)
    meter.patches_formed += 1
    cost = meter.finish()
    assert (cost.reforms, cost.audit_tokens, cost.drift, cost.patches_formed) == (2, 7, 0.25, 1)
    assert cost.forwards == cost.tokens_prefilled == 0 and cost.seconds >= 0
