"""What the agents push on a text model: real text and accessibility-tree screens, at agents' lengths.

Why not random token ids: a real model's KV over random ids measures how random tokens bind,
not how an agent's context does, and its answers mean nothing. A text agent's chunks are:

- tool outputs (a stream's items): passages of the benchmark half of the shipped corpus
  (`kamera_agent.bench.corpus`), behind a tool header;
- screens (video frames, web screenshots): accessibility trees (`kamera_agent.bench.agents.a11y`);
- document pages: passages of the corpus; their low-detail views: a page's opening words;
- transcript lines and the captions that replace dropped screens: short generated lines.

Each chunk's length is drawn from its kind's range (`TextLengths`) and reached in the model's
own tokens (`fit`): units are added until the drawn count is reached, and the text is cut at
a word where it passes the range's top. Everything is deterministic in ``(seed, kind, index)``.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kamera_agent.bench.agents.a11y import caption_words, screen_lines, transcript_words
from kamera_agent.bench.agents.script import Question
from kamera_agent.bench.corpus import passages
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder

__all__ = ["QUICK_TEXT_LENGTHS", "TEXT_LENGTHS", "TEXT_QUESTIONS", "TextContents", "TextLengths", "fit"]

TextLengths = Mapping[str, tuple[int, int]]
"""Content kind -> (fewest, most) tokens of a chunk of that kind."""
TEXT_LENGTHS: TextLengths = MappingProxyType(
    {
        "item": (200, 2000),  # a tool's output
        "frame": (300, 800),  # a screen (accessibility tree)
        "screenshot": (300, 800),
        "page": (500, 1000),
        "overview": (24, 64),  # a page's low-detail view
        "line": (6, 24),  # a transcript line: an action and what it led to
        "caption": (8, 32),  # a dropped screen's replacement
    }
)
"""The lengths text agents have: screens of 300-800 tokens, tool outputs of 200-2,000, pages of
500-1,000, short transcript lines."""
QUICK_TEXT_LENGTHS: TextLengths = MappingProxyType(
    {
        "item": (24, 64),
        "frame": (24, 48),
        "screenshot": (24, 48),
        "page": (32, 64),
        "overview": (8, 16),
        "line": (4, 12),
        "caption": (4, 12),
    }
)
"""Smoke lengths: the same kinds, a few dozen tokens each."""
TEXT_QUESTIONS = (
    Question("What is the latest screen or text about? Answer in one word.", 'One word: "'),
    Question("Which element should the agent act on next?", 'The agent should act on the element "'),
)
"""Asked in turn; each answer is continued from its opening, so its first token names something
read (asked plainly, a small model opens nearly every answer with "The" whatever it read)."""

Count = Callable[[str], int]


@dataclass
class TextContents:
    """Chunks of real text and accessibility-tree screens, each of a length drawn from ``lengths``.

    Args:
        encoder: the model's chunk encoder (its tokenizer counts the lengths).
        lengths: each content kind's token range.
        seed: where every draw comes from.
    """

    encoder: ChunkEncoder
    lengths: TextLengths
    seed: int

    def make(self, kind: str, index: int) -> Chunk:
        return self.encoder.text(self.text(kind, index), label=f"{kind} {index}")

    def text(self, kind: str, index: int) -> str:
        """The ``index``-th chunk of ``kind`` as text, of a length drawn from its range and
        counted in the model's own tokens (ending in a newline: chunks follow one another)."""
        lo, hi = self.lengths[kind]
        target = random.Random(f"length:{self.seed}:{kind}:{index}").randint(lo, hi - 1)
        units, separator = self._units(kind, index), _SEPARATORS.get(kind, " ")
        return fit(units, separator, target, hi - 1, self._count) + "\n"

    def question(self, index: int) -> Question:
        return TEXT_QUESTIONS[index % len(TEXT_QUESTIONS)]

    def _count(self, text: str) -> int:
        return int(self.encoder.tokens(text).numel())

    def _units(self, kind: str, index: int) -> Iterable[str]:
        if kind in ("frame", "screenshot"):
            return screen_lines(self.seed, index)
        if kind == "line":
            return transcript_words(self.seed, index)
        if kind == "caption":
            return caption_words(self.seed, index)
        if kind == "item":
            return [f"Tool output (read_docs, call {index + 1}):", *self._passages(kind, index)]
        if kind == "page":
            return self._passages(kind, index)
        if kind == "overview":  # the opening words of the page it is a view of
            return " ".join(self._passages("page", index)).split()
        raise ValueError(f"unknown content kind {kind!r}; known: {', '.join(TEXT_LENGTHS)}")

    def _passages(self, kind: str, index: int) -> list[str]:
        """Passages of the corpus's benchmark half, in an order of this chunk's own (each holds
        60-200 tokens: 40 reach any length here)."""
        return passages("benchmark", zlib.crc32(f"{self.seed}:{kind}:{index}".encode()), 40)


_SEPARATORS: Mapping[str, str] = MappingProxyType(
    {"frame": "\n", "screenshot": "\n", "item": "\n\n", "page": "\n\n"}
)


def fit(units: Iterable[str], separator: str, target: int, top: int, count: Count) -> str:
    """``units`` joined by ``separator`` until ``count`` reaches ``target``, then cut at the last
    whitespace that keeps it at most ``top`` (within a word where that would fall short of
    ``target``: a long word at the end)."""
    text = ""
    for unit in units:
        text = f"{text}{separator}{unit}" if text else unit
        if count(text) >= target:
            break
    if count(text) <= top:
        return text
    cuts = [match.start() for match in re.finditer(r"\s", text)]
    end = _longest(cuts, text, top, count)
    if end is None or count(text[:end]) < target:
        end = _longest(list(range(1, len(text))), text, top, count) or 1
    return text[:end]


def _longest(ends: list[int], text: str, top: int, count: Count) -> int | None:
    """The largest of ``ends`` (ascending) whose prefix counts at most ``top`` (binary search:
    a prefix's count grows with its length), or ``None``."""
    lo, hi, best = 0, len(ends) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if ends[mid] > 0 and count(text[: ends[mid]]) <= top:
            best, lo = ends[mid], mid + 1
        else:
            hi = mid - 1
    return best
