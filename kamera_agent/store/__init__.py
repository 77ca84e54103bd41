"""The content-addressed store: canonicals, vision embeddings and patches, memory then disk.

`ChunkStore` is the facade; `EntryKey` addresses an entry; eviction policies are scoring
functions in `EVICTION_POLICIES`; `StoreStats` and `StoreEvent` say what the store did.
"""

from kamera_agent.store.budget import EVICTION_POLICIES, EntryInfo, EvictionPolicy
from kamera_agent.store.chunk_store import ChunkStore
from kamera_agent.store.keys import EntryKey, EntryKind
from kamera_agent.store.stats import EventKind, StoreEvent, StoreStats

__all__ = [
    "EVICTION_POLICIES",
    "ChunkStore",
    "EntryInfo",
    "EntryKey",
    "EntryKind",
    "EventKind",
    "EvictionPolicy",
    "StoreEvent",
    "StoreStats",
]
