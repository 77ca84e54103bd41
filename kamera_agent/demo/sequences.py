"""Turning task items into window chunks and training sequences, the same way for both.

Why shared: the model is trained on exactly the token and position layout a `KameraWindow`
builds (anchor, one chunk per frame, the question after them), so what the benchmark measures
is the window's reuse, not a train/serve mismatch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.demo.task import DemoItem, Page, render_legend, render_page

__all__ = ["FrameCache", "ItemSequence", "item_sequence"]


@dataclass
class FrameCache:
    """Chunks of the task's frames, the most recent ``capacity`` kept: items share frames when
    the same few are evaluated under many arms, while training draws fresh ones every step."""

    encoder: ChunkEncoder
    capacity: int = 256
    chunks: OrderedDict[tuple[str, ...], Chunk] = field(default_factory=OrderedDict)

    def legend(self, entries: tuple[tuple[str, str], ...], index: int) -> Chunk:
        """Legend frame ``index`` (1-based) showing ``entries``."""
        key = ("legend", " ".join(f"{glyph}={colour}" for glyph, colour in entries), str(index))
        return self._get(key, lambda: self.encoder.image(render_legend(entries), label=f"legend {index}"))

    def page(self, cells: Page, k: int) -> Chunk:
        """Page ``#k`` showing ``cells``."""
        key = ("page", "".join(cells), str(k))
        return self._get(
            key, lambda: self.encoder.image(render_page(cells), kind="frame", caption=f"#{k}", label=f"#{k}")
        )

    def _get(self, key: tuple[str, ...], make: Callable[[], Chunk]) -> Chunk:
        if key in self.chunks:
            self.chunks.move_to_end(key)
            return self.chunks[key]
        chunk = make()
        self.chunks[key] = chunk
        while len(self.chunks) > self.capacity:
            self.chunks.popitem(last=False)
        return chunk


@dataclass(frozen=True)
class ItemSequence:
    """An item as window chunks plus its query and answer token ids."""

    item: DemoItem
    chunks: list[Chunk]
    query_ids: torch.Tensor
    answer_ids: torch.Tensor


def item_sequence(cache: FrameCache, item: DemoItem) -> ItemSequence:
    """The legend frames, then the pages ``#1``, ``#2``, then the question."""
    chunks = [cache.legend(entries, i) for i, entries in enumerate(item.legend, start=1)]
    chunks += [cache.page(cells, k) for k, cells in enumerate(item.pages, start=1)]
    encoder = cache.encoder
    answer = encoder.tokens(item.answer + "<|im_end|>")
    return ItemSequence(item, chunks, encoder.query_ids(item.question), answer)
