"""What every part of a window shares: its state, its backend, and how to read them.

Why a base: a window's planning (which edits an op needs) and its execution (running them as
cache edits) are separate jobs in separate modules, but both read the same state, the same
positions and the same anchor; they are defined here once.
"""

from __future__ import annotations

from collections.abc import Sequence

from kamera_agent.backends.base import Backend
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.config import WindowConfig
from kamera_agent.errors import UnknownChunkError
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import ChunkStore
from kamera_agent.window.costs import StatsBook
from kamera_agent.window.planner import PlanContext
from kamera_agent.window.state import ChunkRef, Entry, WindowState

__all__ = ["WindowCore"]


class WindowCore:
    """State and read-only helpers of a window (see `KameraWindow`)."""

    config: WindowConfig
    backend: Backend
    _state: WindowState
    _book: StatsBook
    _placed: dict[ChunkRef, tuple[int, int, ChunkKV]]

    def probe_kl(self, ref: ChunkRef, query: str) -> float:
        """Next-token KL of ``query`` with ``ref`` switched off; `KameraWindow` implements it
        with ``probe_without`` (the probe-driven eviction policy scores chunks with it)."""
        raise NotImplementedError

    @property
    def store(self) -> ChunkStore:
        """The content-addressed store of canonicals, vision outputs and patches."""
        return self.backend.store

    @property
    def _anchor(self) -> Chunk:
        return self.backend.anchor

    @property
    def _anchor_kv(self) -> ChunkKV:
        return self.backend.anchor_kv()

    @property
    def _encoder(self) -> ChunkEncoder:
        return self.backend.encoder

    def _ctx(self) -> PlanContext:
        return PlanContext(
            self._anchor.key, self.config.effective_rank, self.config.orbit, self.store.has_patch
        )

    def _starts(self, order: Sequence[ChunkRef]) -> dict[ChunkRef, int]:
        """Where each chunk starts: positions follow from the order, never stored."""
        starts, position = {}, self._anchor.advance
        for ref in order:
            starts[ref] = position
            entry = self._state.entries.get(ref)
            position += entry.chunk.advance if entry is not None else 0  # a chunk being admitted: last
        return starts

    def _end(self) -> int:
        return self._anchor.advance + sum(self._entry(r).chunk.advance for r in self._state.order)

    def _entry(self, ref: ChunkRef) -> Entry:
        if not isinstance(ref, ChunkRef):
            raise UnknownChunkError(f"expected a ChunkRef from this window, got {type(ref).__name__}")
        if ref.lineage != self._state.lineage or ref not in self._state.entries:
            raise UnknownChunkError(f"{ref} does not belong to this window (another window's ref?)")
        return self._state.entries[ref]

    def _in_window(self, ref: ChunkRef) -> ChunkRef:
        if not self._entry(ref).in_window:
            raise UnknownChunkError(f"{ref} is not in the window (evicted); recall it first")
        return ref
