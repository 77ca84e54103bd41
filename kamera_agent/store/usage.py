"""What a shared tier holds, as an operator asks (``kamera store stats|clear``).

Why apart from the `Tier` protocol: counting and deleting every entry of a place is an
operator's command, not a store's call; a tier offers it through two optional classmethods
(`Tier.url_usage`, `Tier.url_clear`) that answer in these terms, so the command knows no tier.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from kamera_agent.errors import StoreUnavailableError

__all__ = ["TierUsage", "answered"]


@dataclass
class TierUsage:
    """kamera's entries where a shared tier keeps them (``kamera store stats``: `Tier.url_usage`).

    Attributes:
        entries: entries by kind (``canonical``, ``full``, ``vision``, ``patch``).
        nbytes: stored bytes by kind (an entry split in parts: all of them).
        parts: part values (pieces of large entries) among them, where a tier splits entries.
        models: entries by model fingerprint.
        notes: what else the place says about itself, a line each (a server's memory limit).
    """

    entries: Counter[str] = field(default_factory=Counter)
    nbytes: Counter[str] = field(default_factory=Counter)
    parts: int = 0
    models: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def answered(where: object, *unanswered: type[BaseException]) -> Iterator[None]:
    """An operator's command on a shared tier (`Tier.url_usage`): any of ``unanswered`` (the
    client's errors for a place that is down, unreachable or refusing) is a
    `StoreUnavailableError` naming ``where``."""
    try:
        yield
    except unanswered as exc:
        raise StoreUnavailableError(f"{where} did not answer: {type(exc).__name__}: {exc}") from exc
