"""The synthetic visual binding task behind the shipped demo model (kamera-tiny-vl).

Why synthetic: no machine here can download a real VLM, yet the demo must *measure* the thing
the paper is about: reuse that drops cross-chunk conditioning breaks answers that need binding
(one chunk read against another) and leaves plain readout intact. An item is a window of frames
rendered with OpenCV:

- **legend frames** (four, 56 x 56, 2 x 2 glyphs each): every glyph drawn in the colour it
  *means*. The mapping (16 glyphs onto 16 colours) is drawn afresh for every item, so it must be
  read, not memorised; what a page means depends on all four frames.
- **pages** (two, 224 x 336, 8 x 12 cells): white glyphs in two cells of three, the rest blank
  (filler that means nothing). 15 of the 16 glyphs are shown, 8 or 9 times each; one is absent.
  A page is 96 vision tokens (100 with its caption and frame markers).

Every glyph fills exactly one merged vision token (2 x 2 patches of 14 pixels), so a page token
is "this glyph" and a legend token is "this glyph, this colour": what a page token means is one
attention hop away, in another chunk. That is the binding blind reuse loses.

Questions:

- ``colour`` (binding): which colour does no glyph on the pages mean? The answer rests on every
  meaning the pages show, not on the most common one, so a patch must repair every meaning's
  direction of the pages' deficit: low ranks fail, and the rank curve has a knee; recomputing a
  share of the tokens leaves most meanings unrepaired.
- ``glyph`` (readout, the negative control): which glyph does the legend draw in red? The answer
  is one legend token's own content: no binding, no aggregation over the pages. (The previous
  readout, which glyph is absent, is the binding question's intermediate: a model that learned it
  well also learned to answer the binding question from it and the legend at the question,
  without the pages' binding, and blind reuse then answered binding far above chance.)

**Sparse-binding control** (`make_item(..., sparse=True)`): the same question on pages that show
each of the 15 glyphs once (8 on one page, 7 on the other), the rest filler. Only those few tokens
bind, so recomputing the few tokens that deviate most should repair the pages: the control shows
the token-recompute baselines are not rigged.
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
    "BLANK",
    "COLOURS",
    "DENSE_GLYPHS",
    "GLYPHS",
    "LEGEND_FRAMES",
    "PAGES_PER_ITEM",
    "PAGE_CELLS",
    "PAGE_COLS",
    "PAGE_ROWS",
    "QUESTIONS",
    "READOUT_COLOUR",
    "SPARSE_GLYPHS",
    "DemoItem",
    "Page",
    "QuestionKind",
    "make_item",
    "make_items",
    "render_legend",
    "render_page",
]

QuestionKind = Literal["colour", "glyph"]
# Short questions: the demo model is small and every token is trained on.
QUESTIONS: dict[QuestionKind, str] = {"colour": "Absent colour?", "glyph": "Red glyph?"}

# 16 meanings: colour names with distinct first letters, so the first answer token decides.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 30, 30),
    "green": (30, 190, 50),
    "blue": (40, 80, 255),
    "yellow": (245, 235, 30),
    "orange": (255, 140, 0),
    "purple": (130, 40, 190),
    "cyan": (30, 235, 235),
    "magenta": (240, 40, 210),
    "navy": (20, 20, 120),
    "teal": (0, 120, 110),
    "lime": (170, 255, 90),
    "khaki": (170, 160, 90),
    "salmon": (250, 150, 130),
    "umber": (110, 60, 20),
    "violet": (200, 150, 255),
    "ash": (120, 120, 120),
}
WHITE = (255, 255, 255)
READOUT_COLOUR = "red"
"""The colour whose glyph the readout question asks for."""

# 16 glyphs: every 4-bit code over a glyph's 2 x 2 cells (filled or hollow square), named by
# capital letters so a readout answer is one token that no colour name starts with.
GLYPHS: dict[str, int] = dict(zip("ABCDEFGHIJKLMNOP", range(16), strict=True))
BLANK = "."
"""A page cell with no glyph (filler)."""

CELL = 14  # pixels: one vision patch
GLYPH = 2 * CELL  # one merged vision token
LEGEND_GRID = 2  # a legend frame is 2 x 2 glyphs
LEGEND_FRAMES = 4
ENTRIES_PER_LEGEND = LEGEND_GRID * LEGEND_GRID
PAGE_ROWS, PAGE_COLS = 8, 12
PAGE_CELLS = PAGE_ROWS * PAGE_COLS
PAGES_PER_ITEM = 2
DENSE_GLYPHS = 64
"""Glyphs on a page of the main task (of `PAGE_CELLS` cells)."""
SPARSE_GLYPHS = 8
"""Glyphs on a page of the sparse-binding control (at most: 15 over the two pages)."""

Page = tuple[str, ...]
"""A page's cells in raster order: a glyph letter or `BLANK`."""


@dataclass(frozen=True)
class DemoItem:
    """One question over one window of frames.

    Attributes:
        legend: per legend frame, its ``(glyph, colour)`` entries in raster order.
        pages: per page, its cells in raster order.
        absent: the glyph no page shows.
        kind: the question's kind.
        question: the question text.
        answer: the expected answer (a colour name or a glyph letter).
        sparse: whether this is a sparse-binding control item.
    """

    legend: tuple[tuple[tuple[str, str], ...], ...]
    pages: tuple[Page, ...]
    absent: str
    kind: QuestionKind
    question: str
    answer: str
    sparse: bool = False

    @property
    def meaning(self) -> dict[str, str]:
        return {glyph: colour for frame in self.legend for glyph, colour in frame}

    @property
    def multi_hop(self) -> bool:
        return self.kind == "colour"

    @property
    def glyph_counts(self) -> Counter[str]:
        return Counter(cell for page in self.pages for cell in page if cell != BLANK)


def make_item(
    rng: random.Random,
    kind: QuestionKind | None = None,
    *,
    sparse: bool = False,
    glyphs_shown: int | None = None,
) -> DemoItem:
    """A random item: a fresh glyph→colour mapping and pages showing all glyphs but one.

    ``glyphs_shown`` overrides the glyphs over both pages (``2 · DENSE_GLYPHS``, or 15 when
    ``sparse``: each present glyph once); the training curriculum starts on sparser pages."""
    chosen: QuestionKind = kind if kind is not None else rng.choice(list(QUESTIONS))
    glyphs = rng.sample(list(GLYPHS), len(COLOURS))
    colours = rng.sample(list(COLOURS), len(COLOURS))
    present = glyphs[1:]  # glyphs[0] is absent
    default = len(present) if sparse else PAGES_PER_ITEM * DENSE_GLYPHS
    shown = glyphs_shown if glyphs_shown is not None else default
    if not len(present) <= shown <= PAGES_PER_ITEM * PAGE_CELLS:
        raise ValueError(f"pages show {len(present)} to {PAGES_PER_ITEM * PAGE_CELLS} glyphs, not {shown}")
    drawn = [present[i % len(present)] for i in range(shown)]  # every present glyph 8 or 9 times
    rng.shuffle(drawn)
    split = -(-shown // PAGES_PER_ITEM)
    pages = []
    for part in (drawn[:split], drawn[split:]):
        cells = sorted(rng.sample(range(PAGE_CELLS), len(part)))
        page = [BLANK] * PAGE_CELLS
        for cell, glyph in zip(cells, part, strict=True):
            page[cell] = glyph
        pages.append(tuple(page))
    entries = list(zip(glyphs, colours, strict=True))
    rng.shuffle(entries)
    legend = tuple(
        tuple(entries[f * ENTRIES_PER_LEGEND : (f + 1) * ENTRIES_PER_LEGEND]) for f in range(LEGEND_FRAMES)
    )
    answer = colours[0] if chosen == "colour" else glyphs[colours.index(READOUT_COLOUR)]
    return DemoItem(legend, tuple(pages), glyphs[0], chosen, QUESTIONS[chosen], answer, sparse)


def make_items(
    count: int, seed: int, kind: QuestionKind | None = None, *, sparse: bool = False
) -> list[DemoItem]:
    """``count`` items from one seed (training and held-out splits use different seeds)."""
    rng = random.Random(seed)
    return [make_item(rng, kind, sparse=sparse) for _ in range(count)]


def render_legend(entries: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> Image.Image:
    """A legend frame: each entry's glyph drawn in its colour, 2 x 2 in raster order."""
    if len(entries) != ENTRIES_PER_LEGEND:
        raise ValueError(f"a legend frame holds {ENTRIES_PER_LEGEND} entries, got {len(entries)}")
    frame = _canvas(LEGEND_GRID, LEGEND_GRID)
    for index, (glyph, colour) in enumerate(entries):
        row, col = divmod(index, LEGEND_GRID)
        _draw_glyph(frame, GLYPHS[glyph], row * GLYPH, col * GLYPH, COLOURS[colour])
    return Image.fromarray(frame, mode="RGB")


def render_page(cells: Page | list[str]) -> Image.Image:
    """A page: its glyphs in white, 8 x 12 cells in raster order, blank cells empty."""
    if len(cells) != PAGE_CELLS:
        raise ValueError(f"a page holds {PAGE_CELLS} cells, got {len(cells)}")
    frame = _canvas(PAGE_ROWS, PAGE_COLS)
    for index, cell in enumerate(cells):
        row, col = divmod(index, PAGE_COLS)
        if cell != BLANK:
            _draw_glyph(frame, GLYPHS[cell], row * GLYPH, col * GLYPH, WHITE)
    return Image.fromarray(frame, mode="RGB")


def _canvas(rows: int, cols: int) -> np.ndarray:
    return np.zeros((rows * GLYPH, cols * GLYPH, 3), dtype=np.uint8)


def _draw_glyph(frame: np.ndarray, code: int, top: int, left: int, ink: tuple[int, int, int]) -> None:
    """A glyph: one square per cell, filled where the code's bit is set, hollow where not, so
    every glyph shows its ink (its colour) in every cell."""
    for bit in range(4):
        row, col = divmod(bit, 2)
        y, x = top + row * CELL, left + col * CELL
        thickness = -1 if code >> bit & 1 else 2
        cv2.rectangle(frame, (x + 2, y + 2), (x + CELL - 3, y + CELL - 3), ink, thickness)
