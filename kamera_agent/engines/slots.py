"""An engine's KV pool as token slots: what a load writes and a capture reads, one protocol.

Why: SGLang holds a layer's KV per slot in its token pools, vLLM in paged blocks laid out by its
attention backend; kamera stores a chunk position-free as ``[layers, heads, tokens, dim]``. Each
engine differs only in how a token's keys and values sit in its memory, so an adapter implements
`read_placed` / `write_placed` in its own layout, and relocation (the rotation to this request's
positions on the way in, its inverse on the way out) is done here, once, for every engine.

    load:    position-free ChunkKV ──relocate(positions)──► write_placed(slots)   (engine layout)
    capture: read_placed(slots) ──► ChunkKV at positions ──to_position_free──► the store
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kamera_agent.operator.layout import ChunkKV, KVLayout, relocate, to_position_free

__all__ = ["KVSlots", "request_positions"]


class KVSlots(ABC):
    """Token slots of one engine's KV pool (every layer), in and out as chunk KV.

    Attributes:
        layout: the model's KV layout (where the rope band sits, its frequencies).
    """

    layout: KVLayout

    @abstractmethod
    def write_placed(self, kv: ChunkKV, slots: torch.Tensor) -> None:
        """Write ``kv`` (keys already rotated to their positions) at ``slots`` ``[n]``, every layer."""

    @abstractmethod
    def read_placed(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` ``[n]``: ``[layers, heads, n, dim]`` each, float32 on the CPU."""

    def write(self, kv: ChunkKV, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Write position-free ``kv`` at ``slots``, its keys rotated to ``positions`` (``[n]``, or
        ``[3, n]`` for M-RoPE: the positions the engine gave these tokens)."""
        self.write_placed(relocate(kv, self.layout, positions), slots)

    def read(self, slots: torch.Tensor, positions: torch.Tensor, chunk_key: str = "") -> ChunkKV:
        """The KV at ``slots`` (written at ``positions``), position-free, float32 on the CPU."""
        keys, values = self.read_placed(slots)
        return to_position_free(ChunkKV(keys, values, positions.cpu(), chunk_key), self.layout)


def request_positions(layout: KVLayout, start: int, end: int) -> torch.Tensor:
    """Positions ``start..end`` of a request's text tokens as the engine gives them: ``[n]``, or
    the same row on each of the three axes for an M-RoPE model (text advances all three)."""
    flat = torch.arange(start, end, dtype=torch.long)
    return flat.expand(3, -1).clone() if layout.rope.axes is not None else flat
