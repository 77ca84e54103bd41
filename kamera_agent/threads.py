"""The background thread a queue of work runs on: what every such queue shares.

Why one piece: the vLLM connector's captures and loads and a shared store tier's writes each
start a daemon thread, count the work submitted and not yet done, take items in order until
closed, and let hooks, shutdown and tests wait until the work is done (``flush``) or stop the
thread (``close``); they differ only in what an item is and how it is done.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["WorkerThread"]

T = TypeVar("T")


class WorkerThread:
    """A daemon thread running ``run`` (started by `start_once`), the condition its owner's queue
    and this share (``lock``), the work not yet done (``busy``) and whether it was closed.

    The owner changes ``busy`` (in its own unit: items, bytes) and ``closed`` under ``lock`` and
    notifies it when either changes.
    """

    def __init__(self, name: str, run: Callable[[], None]) -> None:
        self.lock = threading.Condition()
        self.busy = 0
        self.closed = False
        self._name, self._run = name, run
        self._thread: threading.Thread | None = None

    def start_once(self) -> bool:
        """Start the thread if it is not running (call under ``lock``); whether it started now."""
        if self._thread is not None:
            return False
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return True

    def items(self, queue: deque[T], taken: Callable[[T], None] | None = None) -> Iterator[T]:
        """The items of ``queue`` in order, waiting for each (the thread's loop: ``for item in
        worker.items(queue)``), until closed with nothing left. Each is taken under ``lock``, and
        ``taken(item)`` called there (what the owner records before letting go of the lock)."""
        while True:
            with self.lock:
                while not queue and not self.closed:
                    self.lock.wait()
                if not queue:
                    return
                item = queue.popleft()
                if taken is not None:
                    taken(item)
            yield item

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until nothing is busy (at most ``timeout`` seconds); whether nothing is."""
        with self.lock:
            return self.lock.wait_for(lambda: not self.busy, timeout)

    def close(self, timeout: float = 30.0) -> bool:
        """Finish what is busy (within ``timeout``), then stop the thread; whether it had started."""
        self.flush(timeout)
        with self.lock:
            self.closed = True
            thread = self._thread
            self.lock.notify_all()
        if thread is not None:
            thread.join(timeout=1.0)
        return thread is not None
