"""`WindowPlan.changed` makes what ``dataclasses.replace`` makes, and refuses a field it lacks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kamera_agent.window.plan import WindowPlan


def test_changed_is_replace_and_leaves_the_plan_as_it_was() -> None:
    plan = WindowPlan("slide", (), steps=(), prefix_bound=3)
    changed = plan.changed(declined=True, prefix_bound=7)
    assert changed == replace(plan, declined=True, prefix_bound=7)
    assert (plan.declined, plan.prefix_bound) == (False, 3)
    with pytest.raises(TypeError, match="no field 'decline'"):
        plan.changed(decline=True)
