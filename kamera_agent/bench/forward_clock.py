"""Time inside a backend's forwards, by the side of a comparison running them.

Why: two sides of a comparison (kamera and the prefix cache) run the same model; where they
prefill the same tokens their forwards run the same shapes, so whatever wall one spends beyond
the other outside its forwards is its own work. Wrapping the backend's one forward method (as
LMCache measures a connector by wrapping it) splits each side's wall without touching either.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kamera_agent.backends.transformers import TransformersBackend

__all__ = ["ForwardClock"]


class ForwardClock:
    """Milliseconds ``backend.forward`` ran, by the side named in ``side`` when it ran.

    Example::

        clock = ForwardClock(backend, ("kamera", "prefix"))
        with clock.installed():
            clock.side = "kamera"
            ...  # everything kamera runs; clock.spent["kamera"] grows by its forwards' time
    """

    def __init__(self, backend: TransformersBackend, sides: tuple[str, ...] = ("kamera", "prefix")) -> None:
        self.backend, self.side = backend, sides[0]
        self.spent = dict.fromkeys(sides, 0.0)

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The backend's ``forward`` timed while inside (the class's own method again after)."""
        forward = self.backend.forward

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.spent[self.side] += (time.perf_counter() - began) * 1e3

        self.backend.forward = timed  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.backend.forward
