"""The synthetic visual binding task behind the shipped demo model (kamera-tiny-vl).

Why synthetic: no machine here can download a real VLM, yet the demo must show the thing the
paper is about: reuse that drops cross-chunk conditioning breaks answers that need *binding*
(one chunk read against another) and leaves plain readout intact. An item is a window of
frames rendered with OpenCV:

- **legend frames**: a glyph (top-left quarter) on a colour swatch: "this glyph means this
  colour". The mapping (4 of 16 glyphs onto 4 of 8 colours) is drawn afresh for every item, so
  it must be read, not memorised.
- **symbol frames**: a glyph alone, captioned ``#1`` … ``#5``.

Questions:

- ``majority`` (multi-hop): which colour do most symbol frames mean?
- ``colour`` (multi-hop): which colour does symbol frame ``#k`` mean?
- ``glyph`` (single-hop readout, the negative control): which glyph is in frame ``#k``?

A glyph is a 2 x 2 pattern of 14-pixel cells (one vision patch each) in the frame's top-left
quarter, which is exactly one merged vision token; the legend frame's other three quarters
show its colour, a symbol frame's are grey. So a symbol frame's glyph token is the same vision
token as the legend's, and binding is the classic copy a transformer learns readily: find the
earlier occurrence of this glyph, read the colour next to it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

import cv2
import numpy as np
from PIL import Image

__all__ = [
    "COLOURS",
    "GLYPHS",
    "QUESTIONS",
    "DemoItem",
    "QuestionKind",
    "make_item",
    "make_items",
    "render_legend",
    "render_symbol",
]

QuestionKind = Literal["majority", "colour", "glyph"]
# Short questions: the demo model is small and every token is trained on.
QUESTIONS: dict[QuestionKind, str] = {
    "majority": "Majority colour?",
    "colour": "Colour of #{k}?",
    "glyph": "Glyph of #{k}?",
}

# Meanings: colour names with distinct first letters, so the first answer token decides.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 60),
    "blue": (40, 70, 230),
    "yellow": (240, 220, 40),
    "orange": (250, 140, 20),
    "purple": (140, 50, 180),
    "cyan": (40, 220, 230),
    "magenta": (230, 40, 200),
}

# 16 glyphs: every 4-bit code over the 2 x 2 cells of the frame's top-left quarter, which is
# exactly one merged vision token; named by letters so a readout answer is one token.
GLYPHS: dict[str, int] = dict(zip("abcdefghijklmnop", range(16), strict=True))

FRAME = 56  # pixels: one Qwen-VL image of 4 x 4 patches (4 tokens after the 2 x 2 merge)
CELL = 14
SYMBOLS_PER_ITEM = 5
LEGEND_PER_ITEM = 4
GLYPHS_PER_COLOUR = 1


@dataclass(frozen=True)
class DemoItem:
    """One question over one window of frames.

    Attributes:
        legend: ``(glyph, colour)`` pairs, in the order their frames appear.
        symbols: glyph of each symbol frame ``#1`` … ``#5``.
        kind: the question's kind.
        k: the frame a ``colour``/``glyph`` question asks about (1-based), else 0.
        question: the question text.
        answer: the expected answer (a colour name or a glyph letter).
    """

    legend: tuple[tuple[str, str], ...]
    symbols: tuple[str, ...]
    kind: QuestionKind
    k: int
    question: str
    answer: str

    @property
    def meaning(self) -> dict[str, str]:
        return dict(self.legend)

    @property
    def multi_hop(self) -> bool:
        return self.kind != "glyph"


def make_item(rng: random.Random, kind: QuestionKind | None = None) -> DemoItem:
    """A random item: a fresh glyph→colour mapping, five symbols with a strict majority colour."""
    kinds: list[QuestionKind] = list(QUESTIONS)
    chosen: QuestionKind = kind if kind is not None else rng.choice(kinds)
    glyphs = rng.sample(list(GLYPHS), LEGEND_PER_ITEM)
    colours = rng.sample(list(COLOURS), LEGEND_PER_ITEM // GLYPHS_PER_COLOUR)
    meaning = {glyph: colours[i // GLYPHS_PER_COLOUR] for i, glyph in enumerate(glyphs)}
    winner = rng.choice(colours)
    synonyms = [g for g in glyphs if meaning[g] == winner]
    others = [g for g in glyphs if meaning[g] != winner]
    picked = [rng.choice(synonyms) for _ in range(3)]  # three votes for the winner ...
    picked += [rng.choice(others) for _ in range(2)]  # ... at most two for any other colour
    rng.shuffle(picked)
    legend = tuple((glyph, meaning[glyph]) for glyph in glyphs)
    k = rng.randint(1, SYMBOLS_PER_ITEM) if chosen != "majority" else 0
    answer = {"majority": winner, "colour": meaning[picked[k - 1]], "glyph": picked[k - 1]}[chosen]
    return DemoItem(legend, tuple(picked), chosen, k, QUESTIONS[chosen].format(k=k), answer)


def make_items(count: int, seed: int, kind: QuestionKind | None = None) -> list[DemoItem]:
    """``count`` items from one seed (training and held-out splits use different seeds)."""
    rng = random.Random(seed)
    return [make_item(rng, kind) for _ in range(count)]


def render_legend(
    glyph: str, colour: str, noise: float = 0.0, rng: np.random.Generator | None = None
) -> Image.Image:
    """A legend frame: the glyph in the left half, its colour's swatch in the right half."""
    frame = np.zeros((FRAME, FRAME, 3), dtype=np.uint8)
    frame[:, :] = COLOURS[colour]
    _draw_glyph(frame, GLYPHS[glyph])
    return _finish(frame, noise, rng)


def render_symbol(glyph: str, noise: float = 0.0, rng: np.random.Generator | None = None) -> Image.Image:
    """A symbol frame: the glyph alone (right half a neutral grey)."""
    frame = np.full((FRAME, FRAME, 3), 128, dtype=np.uint8)
    _draw_glyph(frame, GLYPHS[glyph])
    return _finish(frame, noise, rng)


def _draw_glyph(frame: np.ndarray, code: int) -> None:
    """The glyph's quarter: black, with a white square in each cell whose bit is set."""
    frame[: 2 * CELL, : 2 * CELL] = 0
    for bit in range(4):
        if code >> bit & 1:
            row, col = divmod(bit, 2)
            top, left = row * CELL, col * CELL
            cv2.rectangle(frame, (left + 2, top + 2), (left + CELL - 3, top + CELL - 3), (255, 255, 255), -1)


def _finish(frame: np.ndarray, noise: float, rng: np.random.Generator | None) -> Image.Image:
    if noise > 0:
        generator = rng or np.random.default_rng()
        jitter = generator.normal(0.0, noise * 255.0, frame.shape)
        frame = np.clip(frame.astype(np.float64) + jitter, 0, 255).astype(np.uint8)
    return Image.fromarray(frame, mode="RGB")
