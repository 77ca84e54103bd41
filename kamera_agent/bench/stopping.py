"""Stopping a long benchmark cleanly: SIGTERM, and SIGINT even where it started ignored, end it as
Ctrl-C does.

Why: a bench run writes what finished when it is interrupted (its results marked partial). A run
started in the background by a non-interactive shell starts with SIGINT ignored, so Python never
turns it into `KeyboardInterrupt`, and one stopped by a scheduler or ``kill`` gets SIGTERM; either
would otherwise end hours of measurement with nothing written.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["interruptible"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def interruptible() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise `KeyboardInterrupt` in the main thread; the handlers
    there before are put back after. Off the main thread (where Python takes no handlers) it
    changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    for sig in _SIGNALS:
        signal.signal(sig, _interrupt)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")
