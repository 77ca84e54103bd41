"""What the agents push: random-token chunks of fixed sizes, or the demo task's rendered frames.

Why two kinds: wall time on a realistic *shape* depends only on token counts, so the realistic
model (a random-init 1.5B-class slice, text-only) gets random-token chunks whose sizes are set
per content kind; fidelity needs a model that answers, so the shipped demo VLM gets real frames
and pages rendered by `kamera_agent.demo.task` (legend frames, pages, low-detail page views) and
short text lines. Both make the same content kinds, so one script runs on either.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
from PIL import Image

from kamera_agent.bench.agents.script import Question
from kamera_agent.chunks.chunk import Chunk, ChunkKind, content_key
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.demo.task import (
    BLANK,
    LEGEND_FRAMES,
    PAGES_PER_ITEM,
    QUESTIONS,
    DemoItem,
    Page,
    make_items,
    render_legend,
    render_page,
)

__all__ = ["KINDS", "Contents", "DemoContents", "RandomContents"]

KINDS: Mapping[str, ChunkKind] = {
    "item": "frame",  # a stream's new chunk
    "frame": "frame",
    "line": "text",  # a transcript line: an action or an observation
    "screenshot": "screenshot",
    "caption": "text",  # a screenshot's short replacement
    "overview": "page",  # a page's low-detail view
    "page": "page",
}
"""The content kinds a script asks for, and the chunk kind each one is."""

_ACTIONS = ("click", "type", "scroll", "open", "read", "back", "search", "select")


class Contents(Protocol):
    """Makes the ``index``-th chunk of a content kind, and the ``index``-th question."""

    def make(self, kind: str, index: int) -> Chunk: ...

    def question(self, index: int) -> Question: ...


@dataclass
class RandomContents:
    """Random-token chunks of ``tokens[kind]`` tokens each (ids above the special tokens).

    Args:
        encoder: the model's chunk encoder (positions, fingerprint, origin).
        tokens: tokens per chunk of each content kind.
        vocab: the model's vocabulary size.
        seed: where the ids come from (each (kind, index) draws its own, reproducibly).
    """

    encoder: ChunkEncoder
    tokens: Mapping[str, int]
    vocab: int
    seed: int
    first_id: int = 512  # the byte tokenizer's bytes and specials lie below

    def make(self, kind: str, index: int) -> Chunk:
        n = self.tokens[kind]
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{kind}:{index}".encode()))
        ids = torch.randint(self.first_id, self.vocab, (n,), generator=generator)
        types = torch.zeros_like(ids)
        relative, advance = self.encoder.positions.relative(ids, types, None)
        enc = self.encoder
        key = content_key("chunk", enc.model_fingerprint, enc.settings, ids)
        label = f"{kind} {index}"
        return Chunk(KINDS[kind], key, ids, relative, advance, types, label=label, origin=enc.origin)

    def question(self, index: int) -> Question:
        return Question(f"What changed by step {index}?")


@dataclass
class DemoContents:
    """The demo task's content: legend frames and pages, low-detail page views, text lines.

    Video and stream frames cycle through items (four legend frames, then two pages);
    screenshots and document pages are pages (224 x 336: 96 image tokens); a low-detail view is
    the page scaled to 56 x 56 (4 image tokens); lines and captions are short text. Questions
    alternate between the model's two ("Absent colour?", "Red glyph?").
    """

    encoder: ChunkEncoder
    seed: int
    _items: list[DemoItem] = field(default_factory=list, repr=False)

    def _item(self, index: int) -> DemoItem:
        while len(self._items) <= index:
            self._items += make_items(8, self.seed + len(self._items))
        return self._items[index]

    def _page_glyphs(self, index: int) -> Page:
        return self._item(index // PAGES_PER_ITEM).pages[index % PAGES_PER_ITEM]

    def make(self, kind: str, index: int) -> Chunk:
        enc, label = self.encoder, f"{kind} {index}"
        if kind in ("item", "frame"):
            frames = LEGEND_FRAMES + PAGES_PER_ITEM
            item, part = self._item(index // frames), index % frames
            if part < LEGEND_FRAMES:
                return enc.image(render_legend(item.legend[part]), kind="frame", label=label)
            number = part - LEGEND_FRAMES
            image = render_page(item.pages[number])
            return enc.image(image, kind="frame", caption=f"#{number + 1}", label=label)
        if kind == "screenshot":
            shot = render_page(self._page_glyphs(index))
            return enc.image(shot, kind="screenshot", caption=f"#{index % 9 + 1}", label=label)
        if kind in ("overview", "page"):
            page = render_page(self._page_glyphs(index))
            if kind == "overview":
                page = page.resize((56, 56), Image.Resampling.BILINEAR)
            return enc.image(page, kind="page", caption=f"p{index + 1}", label=label)
        if kind == "line":
            return enc.text(f"{_ACTIONS[index % len(_ACTIONS)]} #{index % 9 + 1}", label=label)
        if kind == "caption":
            glyphs = "".join(cell for cell in self._page_glyphs(index) if cell != BLANK)
            return enc.text(f"#{index % 9 + 1}: {glyphs[:4]}", label=label)
        raise ValueError(f"unknown content kind {kind!r}; known: {', '.join(KINDS)}")

    def question(self, index: int) -> Question:
        return Question(QUESTIONS["colour"] if index % 2 == 0 else QUESTIONS["glyph"])
