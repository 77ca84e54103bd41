"""The synthetic visual binding task behind the shipped demo model (kamera-tiny-vl).

Why synthetic: no machine here can download a real VLM, yet the demo must show the thing the
paper is about: reuse that drops cross-chunk conditioning breaks answers that need *binding*
(one chunk read against another) and leaves plain readout intact. An item is a window of
frames rendered with OpenCV:

- **legend frames** (56 x 56, 2 x 2 glyphs): each glyph drawn in the colour it *means*. The
  mapping (8 of 16 glyphs onto the 8 colours) is drawn afresh for every item, so it must be
  read, not memorised. Two legend frames hold the eight entries.
- **pages** (112 x 112, 4 x 4 glyphs): glyphs in white, captioned ``#1``, ``#2``.

Every glyph fills exactly one merged vision token (2 x 2 patches of 14 pixels), so a page
token is "this glyph" and a legend token is "this glyph, this colour": what a page token
means is one attention hop away, in another chunk. That is the binding blind reuse loses.

Questions:

- ``majority`` (multi-hop): which colour do most glyphs on the pages mean?
- ``glyph`` (single-hop readout, the negative control): which glyph is most common on the pages?

The pages hold 16 glyphs that mean up to 8 colours, so a page's conditioning deficit spans
several directions: low ranks repair it partly, rank 16 fully (a graded rank curve).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import cv2
import numpy as np
from PIL import Image

__all__ = [
    "COLOURS",
    "GLYPHS",
    "GLYPHS_PER_PAGE",
    "LEGEND_FRAMES",
    "PAGES_PER_ITEM",
    "QUESTIONS",
    "DemoItem",
    "QuestionKind",
    "make_item",
    "make_items",
    "render_legend",
    "render_page",
]

QuestionKind = Literal["majority", "glyph"]
# Short questions: the demo model is small and every token is trained on.
QUESTIONS: dict[QuestionKind, str] = {"majority": "Majority colour?", "glyph": "Majority glyph?"}

# Meanings: colour names with distinct first letters, so the first answer token decides.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 70),
    "blue": (60, 100, 255),
    "yellow": (240, 225, 40),
    "orange": (250, 140, 20),
    "purple": (160, 70, 220),
    "cyan": (40, 225, 235),
    "magenta": (235, 50, 205),
}
WHITE = (255, 255, 255)

# 16 glyphs: every 4-bit code over a glyph's 2 x 2 cells (filled or hollow square), named by
# letters so a readout answer is one token.
GLYPHS: dict[str, int] = dict(zip("abcdefghijklmnop", range(16), strict=True))

CELL = 14  # pixels: one vision patch
GLYPH = 2 * CELL  # one merged vision token
LEGEND_GRID = 2  # a legend frame is 2 x 2 glyphs
PAGE_GRID = 4  # a page is 4 x 4 glyphs
LEGEND_FRAMES = 2
ENTRIES_PER_LEGEND = LEGEND_GRID * LEGEND_GRID
GLYPHS_PER_PAGE = PAGE_GRID * PAGE_GRID
PAGES_PER_ITEM = 2
WINNER_VOTES = 10  # of the 32 glyphs on the pages; every other meaning gets at most OTHER_VOTES
OTHER_VOTES = 4


@dataclass(frozen=True)
class DemoItem:
    """One question over one window of frames.

    Attributes:
        legend: per legend frame, its ``(glyph, colour)`` entries in raster order.
        pages: per page, its glyphs in raster order.
        kind: the question's kind.
        question: the question text.
        answer: the expected answer (a colour name or a glyph letter).
    """

    legend: tuple[tuple[tuple[str, str], ...], ...]
    pages: tuple[tuple[str, ...], ...]
    kind: QuestionKind
    question: str
    answer: str

    @property
    def meaning(self) -> dict[str, str]:
        return {glyph: colour for frame in self.legend for glyph, colour in frame}

    @property
    def multi_hop(self) -> bool:
        return self.kind == "majority"

    @property
    def glyph_counts(self) -> Counter[str]:
        return Counter(glyph for page in self.pages for glyph in page)


def make_item(rng: random.Random, kind: QuestionKind | None = None) -> DemoItem:
    """A random item: a fresh glyph→colour mapping and pages whose majority meaning is clear."""
    chosen: QuestionKind = kind if kind is not None else rng.choice(list(QUESTIONS))
    glyphs = rng.sample(list(GLYPHS), len(COLOURS))
    colours = rng.sample(list(COLOURS), len(COLOURS))
    total = PAGES_PER_ITEM * GLYPHS_PER_PAGE
    winner = rng.randrange(len(glyphs))
    votes = [winner] * WINNER_VOTES
    others = [i for i in range(len(glyphs)) if i != winner]
    while len(votes) < total:
        pick = rng.choice(others)
        if votes.count(pick) < OTHER_VOTES:
            votes.append(pick)
    rng.shuffle(votes)
    shown = [glyphs[i] for i in votes]
    pages = tuple(
        tuple(shown[p * GLYPHS_PER_PAGE : (p + 1) * GLYPHS_PER_PAGE]) for p in range(PAGES_PER_ITEM)
    )
    entries = list(zip(glyphs, colours, strict=True))
    legend = tuple(
        tuple(entries[f * ENTRIES_PER_LEGEND : (f + 1) * ENTRIES_PER_LEGEND]) for f in range(LEGEND_FRAMES)
    )
    answer = colours[winner] if chosen == "majority" else glyphs[winner]
    return DemoItem(legend, pages, chosen, QUESTIONS[chosen], answer)


def make_items(count: int, seed: int, kind: QuestionKind | None = None) -> list[DemoItem]:
    """``count`` items from one seed (training and held-out splits use different seeds)."""
    rng = random.Random(seed)
    return [make_item(rng, kind) for _ in range(count)]


def render_legend(entries: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> Image.Image:
    """A legend frame: each entry's glyph drawn in its colour, 2 x 2 in raster order."""
    if len(entries) != ENTRIES_PER_LEGEND:
        raise ValueError(f"a legend frame holds {ENTRIES_PER_LEGEND} entries, got {len(entries)}")
    return _grid([(glyph, COLOURS[colour]) for glyph, colour in entries], LEGEND_GRID)


def render_page(glyphs: tuple[str, ...] | list[str]) -> Image.Image:
    """A page: 16 glyphs in white, 4 x 4 in raster order."""
    if len(glyphs) != GLYPHS_PER_PAGE:
        raise ValueError(f"a page holds {GLYPHS_PER_PAGE} glyphs, got {len(glyphs)}")
    return _grid([(glyph, WHITE) for glyph in glyphs], PAGE_GRID)


def _grid(glyphs: list[tuple[str, tuple[int, int, int]]], side: int) -> Image.Image:
    frame = np.zeros((side * GLYPH, side * GLYPH, 3), dtype=np.uint8)
    for index, (glyph, ink) in enumerate(glyphs):
        row, col = divmod(index, side)
        _draw_glyph(frame, GLYPHS[glyph], row * GLYPH, col * GLYPH, ink)
    return Image.fromarray(frame, mode="RGB")


def _draw_glyph(frame: np.ndarray, code: int, top: int, left: int, ink: tuple[int, int, int]) -> None:
    """A glyph: one square per cell, filled where the code's bit is set, hollow where not, so
    every glyph shows its ink (its colour) in every cell."""
    for bit in range(4):
        row, col = divmod(bit, 2)
        y, x = top + row * CELL, left + col * CELL
        thickness = -1 if code >> bit & 1 else 2
        cv2.rectangle(frame, (x + 2, y + 2), (x + CELL - 3, y + CELL - 3), ink, thickness)
