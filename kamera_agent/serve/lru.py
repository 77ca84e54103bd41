"""A least-recently-used map held within a byte limit, never by count.

Why bytes: what a stranger fills a cache with decides its size. A cache of 64 conversation
anchors holds 64 bytes or 64 megabytes as the system prompts sent make it; a cache of decoded
images, one or a hundred. Each cache the server keeps for its clients (decoded images, prepared
messages, conversation framings) is one of these, sized by what its entries hold.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["ByteLRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """Entries kept while their bytes together fit ``limit`` (the least recently used leave
    first; one larger than the whole limit is never kept). Thread-safe.

    Args:
        limit: bytes kept at most.
        size: an entry's bytes.
    """

    def __init__(self, limit: int, size: Callable[[V], int]) -> None:
        self.limit, self._size = limit, size
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        """The entry under ``key`` (now the most recently used), or ``None``."""
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def put(self, key: K, value: V) -> None:
        """Hold ``value`` under ``key`` (an entry already there stays), dropping the least
        recently used entries until the limit holds."""
        size = self._size(value)
        if size > self.limit:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = (value, size)
            self._bytes += size
            while self._bytes > self.limit:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
