"""Turning task items into window chunks and training sequences, the same way for both.

Why shared: the model is trained on exactly the token and position layout a `KameraWindow`
builds (anchor, one chunk per frame, the query after them), so what the benchmark measures
is the window's reuse, not a train/serve mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.demo.task import DemoItem, render_legend, render_symbol

__all__ = ["FrameCache", "ItemSequence", "item_sequence"]


@dataclass
class FrameCache:
    """Chunks of the task's frames, made once: the frame set is finite (legend × colour, symbol × #k)."""

    encoder: ChunkEncoder
    chunks: dict[tuple[str, str], Chunk] = field(default_factory=dict)

    def legend(self, glyph: str, colour: str) -> Chunk:
        key = ("legend", f"{glyph}:{colour}")
        if key not in self.chunks:
            self.chunks[key] = self.encoder.image(render_legend(glyph, colour), label=f"legend {glyph}")
        return self.chunks[key]

    def symbol(self, glyph: str, k: int) -> Chunk:
        key = ("symbol", f"{glyph}:{k}")
        if key not in self.chunks:
            self.chunks[key] = self.encoder.image(
                render_symbol(glyph), kind="frame", caption=f"#{k}", label=f"#{k}"
            )
        return self.chunks[key]


@dataclass(frozen=True)
class ItemSequence:
    """An item as window chunks plus its query and answer token ids."""

    item: DemoItem
    chunks: list[Chunk]
    query_ids: torch.Tensor
    answer_ids: torch.Tensor


def item_sequence(cache: FrameCache, item: DemoItem) -> ItemSequence:
    """Legend frames, then the symbol frames ``#1`` … ``#5``, then the question."""
    chunks = [cache.legend(glyph, colour) for glyph, colour in item.legend]
    chunks += [cache.symbol(glyph, k) for k, glyph in enumerate(item.symbols, start=1)]
    encoder = cache.encoder
    answer = encoder.tokens(item.answer + "<|im_end|>")
    return ItemSequence(item, chunks, encoder.query_ids(item.question), answer)
