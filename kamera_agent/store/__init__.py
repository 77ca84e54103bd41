"""The content-addressed store: canonicals, vision embeddings, patches and audits, in ordered tiers.

`ChunkStore` is the facade; `EntryKey` addresses an entry; each tier (memory, disk, a shared
Valkey/Redis server, or one of your own) is a `Tier` answering with a `Lookup` and a `Status`;
eviction policies are scoring functions in `EVICTION_POLICIES`; `StoreStats` and `StoreEvent`
say what the store did.
"""

from kamera_agent.store.audits import DriftAudit
from kamera_agent.store.chunk_store import ChunkStore
from kamera_agent.store.keys import EntryKey, EntryKind
from kamera_agent.store.limits import EVICTION_POLICIES, EntryInfo, EvictionPolicy
from kamera_agent.store.stats import EventKind, StoreEvent, StoreStats
from kamera_agent.store.tier import Lookup, Status, Tier

__all__ = [
    "EVICTION_POLICIES",
    "ChunkStore",
    "DriftAudit",
    "EntryInfo",
    "EntryKey",
    "EntryKind",
    "EventKind",
    "EvictionPolicy",
    "Lookup",
    "Status",
    "StoreEvent",
    "StoreStats",
    "Tier",
]
