"""What an engine's forward runs over, checked and placed (shared by every engine): one prefill's
chunks, where each sits and what it may attend to; a placed chunk a recompute or a deviation
probe runs on.

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
from kamera_agent.errors import LayoutMismatchError, PositionShapeError, SettingsError
from kamera_agent.operator.layout import ChunkKV, KVLayout, check_layout

if TYPE_CHECKING:
    from kamera_agent.backends.base import VisionFeatures

__all__ = [
    "PlacedChunk",
    "PrefillRun",
    "check_depth",
    "check_indices",
    "hidden_slots",
    "run_positions",
]


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


@dataclass(frozen=True)
class PlacedChunk:
    """A chunk's reused KV where it sits, over the KV to its left: what a recompute or a deviation
    probe runs on.

    Attributes:
        chunk: the chunk ``kv`` belongs to.
        kv: its current KV, placed at ``chunk.positions_at(start)``.
        context: placed KV before the chunk, back to back (the anchor first), as `prefill`'s.
        start: the chunk's first position.
        vision: the chunk's vision outputs, when it has vision.
    """

    chunk: Chunk
    kv: ChunkKV
    context: tuple[ChunkKV, ...]
    start: int
    vision: VisionFeatures | None = None

    @classmethod
    def checked(
        cls,
        chunk: Chunk,
        kv: ChunkKV,
        context: Sequence[ChunkKV],
        start: int,
        vision: VisionFeatures | None,
        layout: KVLayout,
    ) -> PlacedChunk:
        """Refuse KV that is not this chunk's, placed where the chunk starts at ``start``: rows
        recomputed at other positions than the reused ones would mix two placements."""
        check_layout(kv, layout)
        want = chunk.positions_at(start)
        if kv.positions is None or not torch.equal(kv.positions.to("cpu"), want):
            raise PositionShapeError(
                f"the chunk's KV must be placed at chunk.positions_at({start}) ({chunk.num_tokens} tokens); "
                "relocate it there first (apply_patch / relocate)"
            )
        return cls(chunk, kv, tuple(context), start, vision)

    @property
    def cached(self) -> int:
        """Slots of ``context``: where the chunk's first slot is in a cache of context then chunk."""
        return sum(kv.num_tokens for kv in self.context)


def check_indices(indices: torch.Tensor, n: int) -> torch.Tensor:
    """``indices`` as a CPU long tensor, refused unless 1-D, sorted, distinct and within ``[0, n)``."""
    if indices.ndim != 1 or indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise LayoutMismatchError(
            f"indices must be a 1-D integer tensor of token indices, got {indices.dtype} of shape "
            f"{tuple(indices.shape)}"
        )
    out = indices.to("cpu", torch.long)
    if out.numel() and (int(out[0]) < 0 or int(out[-1]) >= n or bool((out[1:] <= out[:-1]).any())):
        raise LayoutMismatchError(
            f"indices must be sorted, distinct and in [0, {n}) (the chunk's tokens); sort them first "
            "(select_tokens returns them sorted)"
        )
    return out


def check_depth(layers: int, num_layers: int) -> None:
    """Refuse a partial forward that measures no layer with context in it, or past the last one."""
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < num_layers:
        raise SettingsError(
            f"deviation layers must be an int in [1, {num_layers}) (decoder layers run before the layer "
            f"compared; layer 0's KV sees no context), got {layers!r}"
        )
