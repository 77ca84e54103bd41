"""Where each chunk of one prefill sits and what it may attend to (shared by every engine).

Why: one forward can condition several chunks even when placed chunks sit between them (a
caption put in an evicted screenshot's slot, then new chunks at the right end): each chunk gets
its own start position and sees only the cached slots to its left, plus the earlier chunks of
the run. Engines turn `hidden_slots` into their own attention mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.errors import LayoutMismatchError

__all__ = ["hidden_slots", "run_positions"]


def run_positions(chunks: Sequence[Chunk], start: int, starts: Sequence[int] | None) -> list[torch.Tensor]:
    """Each chunk's positions: back to back from ``start``, or from its own entry of ``starts``."""
    if starts is not None and len(starts) != len(chunks):
        raise LayoutMismatchError(f"prefill got {len(chunks)} chunks but {len(starts)} starts")
    out, position = [], start
    for i, chunk in enumerate(chunks):
        if starts is not None:
            position = starts[i]
        out.append(chunk.positions_at(position))
        position += chunk.advance
    return out


def hidden_slots(chunks: Sequence[Chunk], cached: int, sees: Sequence[int]) -> torch.Tensor:
    """``[n, cached + n]`` bool, True where a run token must not attend: the cached slots at or
    after its chunk's ``sees`` entry (the run's own tokens stay causal, left to the engine)."""
    if len(sees) != len(chunks):
        raise LayoutMismatchError(f"prefill got {len(chunks)} chunks but {len(sees)} sees entries")
    if any(not 0 <= seen <= cached for seen in sees):
        raise LayoutMismatchError(f"sees entries must lie in [0, {cached}] (the cached slots): {list(sees)}")
    n = sum(chunk.num_tokens for chunk in chunks)
    pairs = zip(chunks, sees, strict=True)
    limit = torch.cat([torch.full((chunk.num_tokens,), seen) for chunk, seen in pairs])
    slot = torch.arange(cached + n)
    return (slot[None, :] >= limit[:, None]) & (slot[None, :] < cached)
