"""Making room: the chunks an eviction policy takes out so that new ones fit the window's
capacity, or the chunks a probe-driven policy must probe first.

Why apart from the per-op planning: it reads only the capacity, the policy and the window's
state, so it is one pure function every admitting op (push, extend, replace, recall) shares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kamera_agent.config import WindowConfig
from kamera_agent.errors import CapacityError
from kamera_agent.policies import EVICTION, EvictionContext
from kamera_agent.window.state import ChunkRef, WindowRecord

__all__ = ["make_room"]


def make_room(
    config: WindowConfig,
    state: WindowRecord,
    tokens: int,
    pinned: Sequence[ChunkRef],
    scores: Mapping[ChunkRef, float] | None = None,
    count: int = 1,
    gone: Sequence[ChunkRef] = (),
) -> tuple[list[ChunkRef], tuple[ChunkRef, ...]]:
    """Chunks to evict so that ``count`` new chunks of ``tokens`` in all fit (``gone`` are
    leaving anyway, ``pinned`` may not leave), or the chunks to probe first."""
    cap_chunks, cap_tokens = config.capacity_chunks, config.capacity_tokens
    if cap_tokens is not None and tokens > cap_tokens:
        raise CapacityError(
            f"{tokens} new tokens can never fit capacity_tokens={cap_tokens}; raise the capacity"
        )
    if cap_chunks is not None and count > cap_chunks:
        raise CapacityError(
            f"{count} new chunks can never fit capacity_chunks={cap_chunks}; raise the capacity"
        )
    leaving = set(gone)
    order = [r for r in state.order if r not in set(pinned) and r not in leaving]
    staying = sum(1 for r in pinned if r in state.order and r not in leaving)
    used = sum(state.entries[r].chunk.num_tokens for r in state.order if r not in leaving)

    def over(evicted: int, used: int) -> bool:
        chunks = cap_chunks is not None and len(order) + staying - evicted + count > cap_chunks
        return chunks or (cap_tokens is not None and used + tokens > cap_tokens)

    if not over(0, used):
        return [], ()
    policy = EVICTION[config.eviction]
    last = state.last_answer
    if policy.probes and last is not None and scores is None:
        cached = state.scores
        if cached is None or (cached.query, cached.tick) != (last.query, state.tick):
            return [], tuple(order)
        scores = cached.kl
    last_used = {r: state.entries[r].last_used for r in order}
    evicted: list[ChunkRef] = []
    for candidate in policy.rank(EvictionContext(order, last_used, scores or None)):
        if not over(len(evicted), used):
            break
        evicted.append(candidate)
        used -= state.entries[candidate].chunk.num_tokens
    return evicted, ()
