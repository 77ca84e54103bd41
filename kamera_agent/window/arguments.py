"""Checking the plain arguments of a window's ops before anything runs: types and ranges.

Why apart: a wrong-typed argument must fail as a named `ArgumentError` that says what was
expected, before the op plans, runs a forward or touches the store; Python's own errors from
deep inside (a tensor shape, ``'<' not supported``) name neither the argument nor the fix, and
some wrong values are silently accepted (``extend("abc")`` as three one-character items). Each
check returns the value it accepted, normalised where there is one meaning (a ``stop`` string).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from kamera_agent.errors import ArgumentError

__all__ = [
    "SEED_LIMIT",
    "check_callable",
    "check_choice",
    "check_flag",
    "check_index",
    "check_int",
    "check_items",
    "check_labels",
    "check_logit_bias",
    "check_real",
    "check_seed",
    "check_slide",
    "check_stop",
    "check_text",
]

SEED_LIMIT = 1 << 63
"""Seeds are ints in ``[0, 2**63)`` (a signed 64-bit integer's non-negative range, as OpenAI's)."""

T = TypeVar("T")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _got(value: object) -> str:
    """``got <type> <repr>``, the repr cut to 60 characters."""
    text = repr(value)
    return f"got {type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_text(value: object, name: str, *, optional: bool = False) -> Any:
    """A ``str`` (or ``None`` when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        expected = "a str or None" if optional else "a str"
        raise ArgumentError(f"{name} must be {expected}, {_got(value)}")
    return value


def check_flag(value: object, name: str) -> bool:
    """A ``bool`` (``True``/``False``; not a truthy object)."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{name} must be True or False, {_got(value)}")
    return value


def check_index(value: object, name: str) -> int | None:
    """``None`` or an ``int`` (the planner checks the range against the window)."""
    if value is not None and not _is_int(value):
        raise ArgumentError(f"{name} must be an int slot index or None (the end), {_got(value)}")
    return value  # type: ignore[return-value]


def check_slide(value: object, size: int) -> int:
    """How many chunks a slide evicts: an int in ``[0, size]`` (more than the window holds is
    refused, not clipped: ``slide(10**9)`` emptying the window is a bug in the caller)."""
    if not _is_int(value):
        raise ArgumentError(f"slide needs an int n >= 0, {_got(value)}")
    n: int = value  # type: ignore[assignment]
    if not 0 <= n <= size:
        raise ArgumentError(
            f"slide({n}) on a window of {size} chunks: n must be in [0, {size}]; slide(len(window)) "
            "empties it"
        )
    return n


def check_int(
    value: object, name: str, low: int = 1, high: int | None = None, *, optional: bool = False
) -> Any:
    """An int in ``[low, high]`` (or ``None`` when ``optional``)."""
    if value is None and optional:
        return None
    if not _is_int(value) or value < low or (high is not None and value > high):  # type: ignore[operator]
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ArgumentError(f"{name} must be an int {span}, {_got(value)}")
    return value


def check_real(
    value: object, name: str, low: float, high: float = math.inf, *, open_low: bool = False
) -> float:
    """A finite real number in ``[low, high]`` (``(low, high]`` with ``open_low``)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        number = float(value)  # type: ignore[arg-type]
        ok = (number > low if open_low else number >= low) and number <= high
    if not ok:
        span = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise ArgumentError(f"{name} must be a finite number in {span}, {_got(value)}")
    return float(value)  # type: ignore[arg-type]


def check_seed(value: object) -> int | None:
    """``None`` or an int in ``[0, 2**63)``."""
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value < SEED_LIMIT:  # type: ignore[operator]
        raise ArgumentError(f"seed must be None or an int in [0, 2**63), {_got(value)}")
    return value  # type: ignore[return-value]


def check_stop(value: object) -> tuple[str, ...]:
    """Stop strings: one ``str`` is one stop string (not its characters), or a sequence of
    non-empty ``str``."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(s, str) and s for s in value):
        raise ArgumentError(f"stop must be a str or a list of non-empty str, {_got(value)}")
    return tuple(value)


def check_logit_bias(value: object) -> dict[int, float]:
    """``None`` or a mapping of token ids (ints >= 0) to numbers in [-100, 100]."""
    if value is None:
        return {}
    ok = isinstance(value, Mapping) and all(
        _is_int(token)
        and token >= 0
        and isinstance(bias, int | float)
        and not isinstance(bias, bool)
        and math.isfinite(bias)
        and abs(bias) <= 100
        for token, bias in value.items()
    )
    if not ok:
        raise ArgumentError(
            f"logit_bias must map token ids (ints >= 0) to numbers in [-100, 100], {_got(value)}"
        )
    return {int(token): float(bias) for token, bias in value.items()}  # type: ignore[attr-defined]


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    """One of ``choices`` (strings)."""
    if not isinstance(value, str) or value not in choices:
        raise ArgumentError(f"{name} must be one of {', '.join(map(repr, choices))}, {_got(value)}")
    return value


def check_callable(value: T | None, name: str) -> T | None:
    """``None`` or a callable."""
    if value is not None and not callable(value):
        raise ArgumentError(f"{name} must be a callable or None, {_got(value)}")
    return value


def check_items(value: object, name: str) -> list[Any]:
    """A list or tuple of items (a ``str`` is one item, not a sequence of them: push it)."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        hint = "; to add one text or image, push it" if isinstance(value, str | bytes) else ""
        raise ArgumentError(f"{name} must be a list of items, {_got(value)}{hint}")
    return list(value)


def check_labels(value: object, count: int) -> list[str | None]:
    """One label (``str`` or ``None``) per item, or ``None`` for no labels."""
    if value is None:
        return [None] * count
    names = check_items(value, "labels")
    if len(names) != count:
        raise ArgumentError(f"got {count} items but {len(names)} labels; give one label per item")
    for name in names:
        check_text(name, "each label", optional=True)
    return names
