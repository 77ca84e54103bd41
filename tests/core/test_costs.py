"""`CostMeter` counts by `OpCost`'s own field names: every field is counted or reported, and a
name that is not a field is refused rather than lost."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kamera_agent.core.costs import COUNTED, CostMeter
from kamera_agent.results import OpCost

FROM_SPENT = {"forwards", "tokens_prefilled", "vision_encodes"}
"""What the meter takes from the primitives' reports rather than counting itself."""


def test_every_op_cost_field_is_counted_by_the_meter_or_reported() -> None:
    assert {f.name for f in fields(OpCost)} == set(COUNTED) | FROM_SPENT | {"seconds", "drift"}


def test_what_the_meter_counts_reaches_the_cost_by_name() -> None:
    meter = CostMeter(drift=0.25)
    meter.add(reforms=2, audit_tokens=7)
    meter.add(patches_formed=1)
    cost = meter.finish()
    assert (cost.reforms, cost.audit_tokens, cost.drift, cost.patches_formed) == (2, 7, 0.25, 1)
    assert cost.forwards == cost.tokens_prefilled == 0 and cost.seconds >= 0


def test_a_name_that_is_no_counter_is_refused() -> None:
    meter = CostMeter()
    with pytest.raises(TypeError, match="reform"):
        meter.add(audits=1, reform=1)
    assert not meter.counts
