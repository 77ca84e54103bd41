"""One operation's view of the store: reads fall through, writes wait until the op succeeds.

Why: a window operation is a transaction over the window *and* the store. Its canonicals,
vision outputs and patches are staged here and only reach the `ChunkStore` when the whole op
has succeeded (`commit`); a failed op discards them, so the store is as it was (no entry
stored, none evicted to make room). An entry larger than the store's budget is used for the
op without being stored, and the commit reports it. The planner reads through the same view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

from kamera_agent.backends.base import VisionFeatures
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.operator.patch import Patch
from kamera_agent.store import ChunkStore, EntryKey
from kamera_agent.store.audits import DriftAudit
from kamera_agent.store.codec import StoredValue

__all__ = ["Committed", "StagedStore", "StoreView", "can_form"]


class StoreView(Protocol):
    """What planning may ask the store: presence and a patch's state, nothing that loads or counts."""

    def has_canonical(self, key: str) -> bool: ...

    def has_vision(self, key: str) -> bool: ...

    def has_full(self, chunk_key: str, state: str) -> bool: ...

    def has_patch(self, chunk_key: str, variant: str) -> bool: ...

    def patch_info(self, chunk_key: str, variant: str) -> tuple[str, dict[str, str]] | None: ...

    def fits(self, nbytes: int) -> bool: ...


def can_form(chunk: Chunk, view: StoreView, state: str = "") -> bool:
    """Whether the chunk's KV can be had: its canonical or the full KV of ``state`` stored, or
    prefilled from its pixels or from a stored vision output (an evicted image keeps neither
    pixels nor KV once the store drops both)."""
    if not chunk.has_vision or chunk.has_pixels or view.has_canonical(chunk.key):
        return True
    if state and view.has_full(chunk.key, state):
        return True
    return chunk.vision_key is not None and view.has_vision(chunk.vision_key)


@dataclass(frozen=True)
class Committed:
    """What a commit wrote: entries stored, their bytes, and entries too large to store."""

    stored: int
    nbytes: int
    uncached: int


class StagedStore:
    """A `ChunkStore` seen through one operation's uncommitted writes."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self._staged: dict[EntryKey, StoredValue] = {}

    # -- reads: staged first, then the store ------------------------------------------------
    def get_canonical(self, key: str) -> ChunkKV | None:
        return _typed(self._get(EntryKey.canonical(key)), ChunkKV)

    def get_full(self, chunk_key: str, state: str) -> ChunkKV | None:
        return _typed(self._get(EntryKey.full(chunk_key, state)), ChunkKV)

    def get_vision(self, key: str) -> VisionFeatures | None:
        return _typed(self._get(EntryKey.vision(key)), dict)

    def get_patch(self, chunk_key: str, variant: str) -> Patch | None:
        return _typed(self._get(EntryKey.patch(chunk_key, variant)), Patch)

    def get_audit(self, chunk_key: str, state: str, left: str) -> DriftAudit | None:
        return _typed(self._get(EntryKey.audit(chunk_key, state, left)), DriftAudit)

    def has_canonical(self, key: str) -> bool:
        return self._has(EntryKey.canonical(key))

    def has_full(self, chunk_key: str, state: str) -> bool:
        return self._has(EntryKey.full(chunk_key, state))

    def has_vision(self, key: str) -> bool:
        return self._has(EntryKey.vision(key))

    def has_patch(self, chunk_key: str, variant: str) -> bool:
        return self._has(EntryKey.patch(chunk_key, variant))

    def _get(self, key: EntryKey) -> StoredValue | None:
        staged = self._staged.get(key)
        return staged if staged is not None else self.store.get(key)

    def _has(self, key: EntryKey) -> bool:
        return key in self._staged or self.store.contains(key)

    def patch_info(self, chunk_key: str, variant: str) -> tuple[str, dict[str, str]] | None:
        staged = self._staged.get(EntryKey.patch(chunk_key, variant))
        if isinstance(staged, Patch):
            return staged.state, dict(staged.meta)
        return self.store.patch_info(chunk_key, variant)

    def fits(self, nbytes: int) -> bool:
        return self.store.fits(nbytes)

    # -- writes: staged until commit --------------------------------------------------------
    def put_canonical(self, kv: ChunkKV) -> None:
        self._staged[EntryKey.canonical(kv.chunk_key)] = kv

    def put_full(self, kv: ChunkKV, state: str) -> None:
        self._staged[EntryKey.full(kv.chunk_key, state)] = kv

    def put_vision(self, key: str, outputs: VisionFeatures) -> None:
        self._staged[EntryKey.vision(key)] = dict(outputs)

    def put_patch(self, patch: Patch, variant: str | None = None) -> None:
        self._staged[EntryKey.patch(patch.chunk_key, patch.state if variant is None else variant)] = patch

    def put_audit(self, audit: DriftAudit) -> None:
        self._staged[EntryKey.audit(audit.chunk_key, audit.state, audit.left)] = audit

    def discard(self) -> None:
        """Forget every staged write (a failed op)."""
        self._staged.clear()

    @property
    def pending(self) -> int:
        """Entries waiting for the commit."""
        return len(self._staged)

    def commit(self) -> Committed:
        """Write every staged entry that fits the store's budget, in the order it was staged (one
        batch: each entry's size is computed once, the store's lock taken once)."""
        done = self.store.put_many(self._staged.items())
        self._staged.clear()
        return Committed(done.stored, done.nbytes, done.too_large)


_T = TypeVar("_T")


def _typed(value: StoredValue | None, kind: type[_T]) -> _T | None:
    """``value`` if it is a ``kind`` (what its address's kind stores), else ``None``."""
    return value if isinstance(value, kind) else None
