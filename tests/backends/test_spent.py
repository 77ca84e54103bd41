"""`Spent` adds up field by field (its sum is spelled out: a field added later must join it)."""

from __future__ import annotations

from dataclasses import fields

from kamera_agent.backends.base import Spent


def test_spent_sums_every_field() -> None:
    names = [f.name for f in fields(Spent)]
    one = Spent(**{name: i + 1 for i, name in enumerate(names)})
    two = Spent(**{name: 10 * (i + 1) for i, name in enumerate(names)})
    total = one + two
    assert {name: getattr(total, name) for name in names} == {
        name: 11 * (i + 1) for i, name in enumerate(names)
    }
