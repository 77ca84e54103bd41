"""The stores an engine process opens: one per model fingerprint and settings, closed together.

Why a registry: an engine builds kamera's adapter more than once in one process (vLLM builds a
scheduler-side and a worker-side connector; SGLang a cache per scheduler), and every instance for
one model and settings must see one store, or a capture would never be served. The registry
opens each store once (`engine_store`) and `close` finishes them all: the disk tier released,
the shared tier's queued writes sent (a server's shutdown, a test's end).

Where no store is named (no ``store_url``, no ``KAMERA_STORE_URL``) an engine still runs in
several processes (``vllm serve``'s scheduler and worker, several servers of one machine), and a
memory store of each would serve a capture only to the process that made it. So the engine's
store is then a disk store in a per-user cache folder (`default_store_dir`; ``disk_dir`` when
the settings name one),
every put written there at once and every process of the machine reading it: bounded by
``disk_limit`` (`DEFAULT_DISK_LIMIT` without one), one folder per model, named in one log line.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from kamera_agent.checkpoints import cache_dir
from kamera_agent.config import WindowConfig
from kamera_agent.store import ChunkStore
from kamera_agent.store.instrumented import TierGrowth

__all__ = [
    "DEFAULT_DISK_LIMIT",
    "STORES",
    "STORE_DIR_VARIABLE",
    "StoreRegistry",
    "default_store_dir",
    "engine_store",
]

_LOG = logging.getLogger(__name__)
DEFAULT_DISK_LIMIT = 20 << 30
"""Bytes the default store keeps per model (the oldest-used entries leave first)."""
STORE_DIR_VARIABLE = "KAMERA_STORE_DIR"
"""The environment variable naming the default stores' folder (else ``<cache>/store``)."""


def default_store_dir(fingerprint: str) -> Path:
    """Where an engine with no store named keeps a model's entries: ``$KAMERA_STORE_DIR/<model>``,
    else ``<cache>/store/<model>`` (`kamera_agent.checkpoints.cache_dir`: ``$KAMERA_CACHE_DIR``
    or ``~/.cache/kamera``)."""
    root = os.environ.get(STORE_DIR_VARIABLE)
    return (Path(root) if root else cache_dir() / "store") / fingerprint[:32]


def engine_store(fingerprint: str, config: WindowConfig) -> ChunkStore:
    """The store an engine's processes share under ``config``: the settings' own where they name
    a shared tier, else a disk store every process of this machine reads and writes at once."""
    if config.shared_store_url is not None:
        return config.open_store(fingerprint)
    directory = config.disk_dir or default_store_dir(fingerprint)
    limit = config.disk_limit or DEFAULT_DISK_LIMIT
    store = config.open_store(fingerprint, disk=(directory, limit), disk_shared=True)
    _LOG.warning(  # a warning: the one line an engine's default logging shows
        "kamera: no store URL (store_url or KAMERA_STORE_URL), so this engine's processes share the "
        "disk store in %s (at most %.1f GiB); set KAMERA_STORE_URL to share captures across machines",
        directory,
        limit / (1 << 30),
    )
    return store


class StoreRegistry:
    """Stores by model fingerprint and settings, opened on first use. Thread-safe."""

    def __init__(self) -> None:
        self._stores: dict[str, ChunkStore] = {}
        self._growth: dict[int, TierGrowth] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def open(self, fingerprint: str, config: WindowConfig) -> ChunkStore:
        """The store of this model under ``config``'s store settings (opened once per process,
        `engine_store`: a forked worker opens its own, never its parent's connections)."""
        key = f"{fingerprint}|{config.model_dump_json()}|{config.shared_store_url}"
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's stores are the parent's
                self._stores, self._growth, self._pid = {}, {}, os.getpid()
            if key not in self._stores:
                self._stores[key] = engine_store(fingerprint, config)
            return self._stores[key]

    def tier_growth(self, store: ChunkStore) -> dict[str, dict[str, float]]:
        """What ``store``'s tiers did since the last call for it in this process (`TierGrowth`):
        the adapter's parts that share a process share its store (vLLM's scheduler and worker
        sides in one process), and each count must reach the engine's metrics once."""
        with self._lock:
            growth = self._growth.setdefault(id(store), TierGrowth())
        return growth.since(store.tier_stats())

    def close(self) -> None:
        """Close every store opened here (`ChunkStore.close`) and forget them: a later `open`
        opens a fresh one."""
        with self._lock:
            stores, self._stores, self._growth = list(self._stores.values()), {}, {}
        for store in stores:
            store.close()

    def __len__(self) -> int:
        return len(self._stores)


STORES = StoreRegistry()
"""This process's stores: what the engine adapters open theirs through."""
