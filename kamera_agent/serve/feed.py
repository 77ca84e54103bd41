"""A request answered in a worker thread, its text handed to the event loop piece by piece.

Why its own module: both streamed routes (chat completions and responses) run the model the
same way (one thread per streamed request, the answer's pieces through an asyncio queue, a
client gone away cancelling the decode) and differ only in the events they write.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

from kamera_agent.serve.protocol import ChatRequest, RequestError, internal_error
from kamera_agent.serve.server import KameraServer

__all__ = ["Cancellation", "Feed"]


class Cancellation:
    """A request's generation, stoppable when its client goes away: ``keep_going`` is asked
    before each decode step; ``cancel`` is called when the client is seen gone."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.steps = 0
        self.steps_at_cancel: int | None = None

    def keep_going(self) -> bool:
        if self._event.is_set():
            return False
        self.steps += 1
        return True

    def cancel(self) -> None:
        if not self._event.is_set():
            self.steps_at_cancel = self.steps
            self._event.set()

    @property
    def after_cancel(self) -> int:
        """Decode steps begun after the client was seen gone (0 or 1: the one in flight)."""
        return 0 if self.steps_at_cancel is None else self.steps - self.steps_at_cancel


class Feed:
    """Starts ``request`` in a thread; `next` gives ``("text", piece)``, then ``("done",
    Completion)`` or ``("refused", RequestError)``. Must be created on the event loop."""

    def __init__(
        self, server: KameraServer, request: ChatRequest, tenant: str, arrived: float | None = None
    ) -> None:
        self.server, self.cancellation = server, Cancellation()
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        threading.Thread(
            target=self._work, args=(request, tenant, arrived), name="kamera-request", daemon=True
        ).start()

    async def next(self) -> tuple[str, Any]:
        return await self._events.get()

    def cancel(self) -> None:
        """No decode step more for this request (its client went away, or its stream ended)."""
        self.cancellation.cancel()

    def _put(self, kind: str, value: Any) -> None:
        """Hand an event to the request's handler; nothing where the server's loop has closed (it
        shut down while this request worked: no one is left to tell, and the worker must not die
        raising)."""
        with contextlib.suppress(RuntimeError):  # asyncio's "Event loop is closed"
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))

    def _work(self, request: ChatRequest, tenant: str, arrived: float | None) -> None:
        try:
            done = self.server.complete(
                request,
                tenant=tenant,
                on_text=lambda text: self._put("text", text),
                keep_going=self.cancellation.keep_going,
                arrived=arrived,
            )
            if self.cancellation.steps_at_cancel is not None:
                self.server.metrics.after_cancel(self.cancellation.after_cancel)
            self._put("done", done)
        except RequestError as exc:
            self._put("refused", exc)
        except Exception as exc:  # reported to this client; the server keeps serving
            self._put("refused", internal_error(exc))
