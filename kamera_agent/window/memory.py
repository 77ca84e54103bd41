"""What a window holds of the chunks that left it, after each operation.

Why bounded: a long-running agent pushes without end, and an image's preprocessed pixels are
most of what it holds (a real 1024² frame is megabytes). After a committed operation an
evicted image releases its pixels once its vision output or canonical is stored (they can be
rebuilt from either), and beyond ``max_evicted`` the oldest evicted chunks are forgotten.
"""

from __future__ import annotations

from collections.abc import Sequence

from kamera_agent.config import WindowConfig
from kamera_agent.core.costs import CostMeter
from kamera_agent.store import ChunkStore
from kamera_agent.window.state import ChunkRef, WindowRecord

__all__ = ["release_evicted"]


def release_evicted(
    state: WindowRecord,
    store: ChunkStore,
    config: WindowConfig,
    evicted: Sequence[ChunkRef],
    meter: CostMeter,
) -> None:
    """Drop the pixels of the chunks just evicted (where the store can rebuild them) and forget
    the oldest evicted chunks beyond ``config.max_evicted``.

    Mutates: ``state`` (entries' chunks, forgotten entries); ``meter.forgotten``.
    """
    if config.evicted_pixels == "drop":
        for ref in evicted:
            entry = state.entries[ref]
            chunk = entry.chunk
            vision = chunk.vision_key is not None and store.has_vision(chunk.vision_key)
            if chunk.has_pixels and (vision or store.has_canonical(chunk.key)):
                entry.chunk = chunk.without_pixels()
    limit = config.max_evicted
    if limit is None or len(state.entries) - len(state.order) <= limit:
        return  # most ops: nothing to forget, nothing to walk (an entry not in the order is evicted)
    gone = [(entry.evicted_at, ref) for ref, entry in state.entries.items() if not entry.in_window]
    gone.sort(key=lambda item: (item[0], item[1].id, item[1].lineage))  # a ref orders by (id, lineage)
    for _, ref in gone[: len(gone) - limit]:
        state.remove(ref)
        meter.add(forgotten=1)
