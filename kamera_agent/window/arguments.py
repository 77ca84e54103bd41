"""Checking the plain arguments of a window's ops before anything runs: types and ranges.

Why apart: a wrong-typed argument must fail as a named `ArgumentError` that says what was
expected, before the op plans, runs a forward or touches the store; Python's own errors from
deep inside (a tensor shape, ``'<' not supported``) name neither the argument nor the fix, and
some wrong values are silently accepted (``extend("abc")`` as three one-character items). Each
check returns the value it accepted. Decode settings are not checked here: `DecodeConfig` checks
them once, where it is built (`check_decode` only reads the deprecated keyword form into one).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from kamera_agent.backends.decode_config import HOOKS, DecodeConfig
from kamera_agent.errors import ArgumentError, SettingsError

__all__ = [
    "check_callable",
    "check_choice",
    "check_decode",
    "check_flag",
    "check_index",
    "check_int",
    "check_items",
    "check_labels",
    "check_slide",
    "check_text",
]

DECODE_KEYWORDS = tuple(f.name for f in dataclasses.fields(DecodeConfig) if f.name not in HOOKS)
"""``ask``'s keywords that are decode settings: deprecated for ``ask(..., decode=DecodeConfig(...))``."""

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


def check_decode(decode: object, keywords: Mapping[str, Any], max_new_tokens: int) -> DecodeConfig:
    """An ``ask``'s decode settings: ``decode`` as given, else built from the deprecated decode
    keywords (``max_new_tokens`` the window's default), else the window's defaults.

    Raises:
        ArgumentError: ``decode`` not a `DecodeConfig`, an unknown keyword, ``decode`` and a decode
            keyword both given, or a keyword's value refused (named as `DecodeConfig` names it).
    """
    unknown = sorted(set(keywords) - set(DECODE_KEYWORDS))
    if unknown:
        raise ArgumentError(f"ask() got an unexpected keyword argument {unknown[0]!r}")
    if decode is not None and not isinstance(decode, DecodeConfig):
        raise ArgumentError(f"decode must be a DecodeConfig or None, {_got(decode)}")
    if decode is not None and keywords:
        raise ArgumentError(
            f"ask got decode= and {', '.join(sorted(keywords))}: put every decode setting in the DecodeConfig"
        )
    if decode is not None:
        return decode
    if keywords:
        warnings.warn(
            f"ask({', '.join(f'{name}=' for name in sorted(keywords))}...) is deprecated: pass "
            "decode=DecodeConfig(...) with these settings",
            DeprecationWarning,
            stacklevel=3,
        )
    settings = {name: value for name, value in keywords.items() if value is not None}
    settings.setdefault("max_new_tokens", max_new_tokens)
    stop = settings.get("stop", ())
    settings["stop"] = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop
    try:
        return DecodeConfig(**settings)
    except SettingsError as exc:  # the keywords are ask's arguments: refused as every op's are
        raise ArgumentError(str(exc)) from exc
