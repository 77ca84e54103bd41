"""The stores an engine process opens: one per model fingerprint and settings, closed together.

Why a registry: an engine builds kamera's adapter more than once in one process (vLLM builds a
scheduler-side and a worker-side connector; SGLang a cache per scheduler), and every instance for
one model and settings must see one store, or a capture would never be served. The registry
opens each store once (`WindowConfig.open_store`) and `close` finishes them all: the disk tier
flushed and released, the shared tier's queued writes sent (a server's shutdown, a test's end).
"""

from __future__ import annotations

import threading

from kamera_agent.config import WindowConfig
from kamera_agent.store import ChunkStore

__all__ = ["STORES", "StoreRegistry"]


class StoreRegistry:
    """Stores by model fingerprint and settings, opened on first use. Thread-safe."""

    def __init__(self) -> None:
        self._stores: dict[str, ChunkStore] = {}
        self._lock = threading.Lock()

    def open(self, fingerprint: str, config: WindowConfig) -> ChunkStore:
        """The store of this model under ``config``'s store settings (opened once)."""
        key = f"{fingerprint}|{config.model_dump_json()}"
        with self._lock:
            if key not in self._stores:
                self._stores[key] = config.open_store(fingerprint)
            return self._stores[key]

    def close(self) -> None:
        """Close every store opened here (`ChunkStore.close`) and forget them: a later `open`
        opens a fresh one."""
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            store.close()

    def __len__(self) -> int:
        return len(self._stores)


STORES = StoreRegistry()
"""This process's stores: what the engine adapters open theirs through."""
