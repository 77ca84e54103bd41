"""Turns at the model: one request at a time, handed on between decode steps to whoever waits.

Why: the model runs one forward at a time, and a plain lock let one request keep it for its whole
answer (several choices of a long answer whose end token is banned), while a one-token request
waited behind all of it. Here a request takes a turn (`ModelTurns.turn`), and before each decode step
(`Turn.step`) it hands the model to the requests waiting, first come first served, and queues
again behind them. A request waits for at most the step in flight and one turn of each request
ahead of it; what is not a decode step (a window edit, bounded by the context) is not cut.

Windows of different sessions can interleave so: a window's op is one transaction over its own
state and the thread-safe store, and an answer's cache is its own. One session's requests must
not: a waiter may ask to be served only once a condition holds (`Turn.wait_until`: its session
free), and the requests behind it are not held up meanwhile.

The server counts decode steps (`ModelTurns.steps`), and each turn the steps of others it waited
through (`Turn.waited`), so a client can see how long it stood in line.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["ModelTurns", "Turn"]

Ready = Callable[[], bool]


class ModelTurns:
    """The model's turns: at most one holder, waiters served in arrival order (a waiter whose
    condition does not hold yet is passed over, not waited for). Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[tuple[object, Ready | None]] = []
        self._held = False
        self.steps = 0
        """Decode steps taken under the model since the server started."""

    @contextmanager
    def turn(self) -> Iterator[Turn]:
        """Hold the model (waiting for a turn first); released however the block ends."""
        turn = Turn(self)
        turn.waited += self._acquire(None)
        try:
            yield turn
        finally:
            self._release()

    @property
    def waiting(self) -> int:
        """Requests waiting for the model now."""
        with self._cond:
            return len(self._queue)

    def _acquire(self, ready: Ready | None) -> int:
        """Wait for the model; the decode steps others took meanwhile."""
        with self._cond:
            ticket = object()
            self._queue.append((ticket, ready))
            start = self.steps
            try:
                self._cond.wait_for(lambda: self._first_ready() is ticket)
            finally:  # served, or interrupted: either way no longer waiting
                self._queue = [entry for entry in self._queue if entry[0] is not ticket]
            self._held = True
            return self.steps - start

    def _release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def _first_ready(self) -> object | None:
        """The waiter to serve next: the earliest whose condition holds (none while held)."""
        if self._held:
            return None
        return next((ticket for ticket, ready in self._queue if ready is None or ready()), None)

    def _step(self) -> bool:
        """Count a decode step; whether someone waits who could be served instead."""
        with self._cond:
            self.steps += 1
            return any(ready is None or ready() for _, ready in self._queue)


class Turn:
    """One request's hold on the model.

    Attributes:
        waited: decode steps of other requests that ran while this one waited for the model.
    """

    def __init__(self, turns: ModelTurns) -> None:
        self._turns = turns
        self.waited = 0

    def step(self) -> None:
        """Before a decode step: if others wait, let them have the model, and queue behind them."""
        if self._turns._step():
            self._turns._release()
            self.waited += self._turns._acquire(None)

    def wait_until(self, ready: Ready) -> None:
        """Give the model up until ``ready()`` holds (checked whenever a turn ends), then take
        it back; returns at once if it holds now. ``ready`` is read under the turns' lock."""
        if ready():
            return
        self._turns._release()
        self.waited += self._turns._acquire(ready)
