"""Keys remembered for a while: what a shared store learned that stays true only so long.

Why one piece: a shared tier remembers names it found absent (a second lookup soon after need
not ask the server again), and an engine remembers entries its workers filed (present before
the store it reads shows them); both are true only for a few seconds, and both must stay small
however many keys pass through.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["Expiring"]

K = TypeVar("K", bound=Hashable)


class Expiring(Generic[K]):
    """Keys, each remembered for ``seconds`` after it was last added, at most ``limit`` of them
    (the oldest forgotten first). Thread-safe.

    Args:
        seconds: how long a key is remembered.
        limit: the most keys remembered at once.
    """

    def __init__(self, seconds: float, limit: int = 65536) -> None:
        self.seconds, self.limit = seconds, limit
        self._until: OrderedDict[Hashable, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, *keys: K) -> None:
        """Remember ``keys`` for ``seconds`` from now."""
        self.add_all(keys)

    def add_all(self, keys: Iterable[K]) -> None:
        until = time.monotonic() + self.seconds
        with self._lock:
            for key in keys:
                self._until[key] = until
                self._until.move_to_end(key)
            while len(self._until) > self.limit:
                self._until.popitem(last=False)

    def discard(self, key: K) -> None:
        """Forget ``key`` (what was learned about it no longer holds)."""
        with self._lock:
            self._until.pop(key, None)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            until = self._until.get(key) if isinstance(key, Hashable) else None
            if until is None:
                return False
            if time.monotonic() < until:
                return True
            del self._until[key]
            return False

    def __len__(self) -> int:
        return len(self._until)
