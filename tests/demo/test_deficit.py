"""The deficit's depth ratio compares halves of the layers fairly."""

from __future__ import annotations

import math

from kamera_agent.demo.evaluate import Deficit


def test_depth_ratio_is_per_layer_means_of_the_halves_without_layer_zero() -> None:
    # layer 0 sees no context; layers 1-2 the shallower half, 3-5 the deeper half
    assert Deficit(energy=[0.0, 1.0, 3.0, 4.0, 4.0, 4.0]).deep_over_shallow == 2.0
    assert Deficit(energy=[0.0, 2.0, 2.0, 2.0]).deep_over_shallow == 1.0  # flat: 1x, not 2x
    assert math.isnan(Deficit(energy=[0.0, 0.0, 1.0, 1.0]).deep_over_shallow)


def test_tallies_add_up() -> None:
    total = Deficit(chunks=1, energy=[0.0, 1.0], relative=[0.0, 0.5], rank90=[3], order_change=[0.2])
    total.add(Deficit(chunks=2, energy=[0.0, 2.0], relative=[0.0, 1.0], rank90=[4, 5], order_change=[0.4]))
    assert total.chunks == 3 and total.energy == [0.0, 3.0] and total.relative == [0.0, 1.5]
    assert total.rank90 == [3, 4, 5] and total.order_change == [0.2, 0.4]
