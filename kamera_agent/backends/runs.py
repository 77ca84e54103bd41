"""Where each chunk of one prefill sits and what it may attend to (shared by every engine).

Why: one forward can condition several chunks even when placed chunks sit between them (a
caption put in an evicted screenshot's slot, then new chunks at the right end): each chunk gets
its own start position and sees only the cached slots to its left, plus the earlier chunks of
the run. Engines turn `hidden_slots` into their own attention mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.errors import LayoutMismatchError

if TYPE_CHECKING:
    from kamera_agent.backends.base import VisionFeatures

__all__ = ["PrefillRun", "hidden_slots", "run_positions"]


@dataclass(frozen=True)
class PrefillRun:
    """One prefill's chunks, checked and placed: what an engine's forward starts from.

    Attributes:
        chunks: the chunks, in the order they run.
        positions: each chunk's positions (`run_positions`).
        vision: the vision outputs of the run's image chunks, in order.
        sees: each chunk's count of leading cached slots it attends to (``None``: all of them).
    """

    chunks: tuple[Chunk, ...]
    positions: tuple[torch.Tensor, ...]
    vision: tuple[VisionFeatures, ...] = ()
    sees: tuple[int, ...] | None = None

    @classmethod
    def of(
        cls,
        chunks: Sequence[Chunk],
        start: int,
        vision: Sequence[VisionFeatures] = (),
        *,
        starts: Sequence[int] | None = None,
        sees: Sequence[int] | None = None,
    ) -> PrefillRun:
        if not chunks:
            raise ValueError("prefill needs at least one chunk")
        positions = tuple(run_positions(chunks, start, starts))
        return cls(tuple(chunks), positions, tuple(vision), None if sees is None else tuple(sees))

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([chunk.input_ids for chunk in self.chunks])

    @property
    def mm_token_type_ids(self) -> torch.Tensor:
        return torch.cat([chunk.mm_token_type_ids for chunk in self.chunks])

    @property
    def tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    def hidden(self, cached: int) -> torch.Tensor | None:
        """`hidden_slots` over ``cached`` slots before the run (``None`` where every chunk sees all)."""
        return None if self.sees is None else hidden_slots(self.chunks, cached, self.sees)


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
