"""Real text for text models' episodes: passages of the Python Language Reference.

Why real text: a calibration fitted on random token ids measures how random tokens bind, not how
the prose a model serves does (random ids barely attend to each other, so their drift is another
quantity). A text model's calibration episodes and its window suite push passages of a real text
instead (`texts/NOTICE.md`), or the user's own files. The topics are split in two halves by a
fixed rule (each distinct passage by its digest), calibration and benchmark, so no benchmark is
judged on text a calibration fitted.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Literal

from kamera_agent.errors import SettingsError

__all__ = ["CORPUS", "FILES_QUESTION", "QUESTION", "Half", "passages", "question", "read_passages"]

CORPUS = Path(__file__).resolve().parent / "texts" / "python-reference.txt"
"""The shipped corpus: one topic after another, each under a ``=== topic`` line."""

Half = Literal["calibration", "benchmark"]

QUESTION = (
    "Which Python feature do these passages describe?",
    'The Python feature these passages describe is called "',
)
"""What a text episode over the corpus asks after every op: the question, and the opening of the
answer the model continues. Its first token is what the episode compares with a re-prefill, so
it must depend on what was read: asked plainly, a small model opens nearly every answer with
"The" whatever the passages say, and agreeing on it shows nothing."""
FILES_QUESTION = ("What are these passages about? Answer with one word.", 'One word: "')
"""The same for passages of the user's own files (any topic)."""

_SHORTEST, _LONGEST = 240, 800
"""A passage's characters: paragraphs are joined up to at least the first (~60 tokens) and cut
before passing the second (~200 tokens), the sizes of the chunks a text agent pushes."""


def passages(half: Half, seed: int, count: int, files: Sequence[Path] = ()) -> list[str]:
    """``count`` passages of ``half`` of the corpus (or of ``files``, all of them), drawn in a
    seeded order (repeating once all are used)."""
    pool = read_passages(tuple(files)) if files else _half(half)
    if not pool:
        raise SettingsError("the texts hold no passage of text; pass files of prose (--texts FILE ...)")
    order = list(pool)
    random.Random(seed).shuffle(order)
    return [order[i % len(order)] for i in range(count)]


def question(files: Sequence[Path] = ()) -> tuple[str, str]:
    """The question and answer opening an episode over ``files`` (none: the corpus) asks."""
    return FILES_QUESTION if files else QUESTION


@cache
def read_passages(files: tuple[Path, ...]) -> tuple[str, ...]:
    """Every passage of ``files``, in order (paragraphs joined to `_SHORTEST`, cut at `_LONGEST`;
    a ``=== title`` line, the corpus's topic marker, starts a new text)."""
    out: list[str] = []
    for file in files:
        for text in re.split(r"^=== .*$", file.read_text(encoding="utf-8"), flags=re.MULTILINE):
            out += _split(text)
    return tuple(out)


@cache
def _half(half: Half) -> tuple[str, ...]:
    """The distinct passages of the corpus whose digest puts them in ``half`` (the reference
    repeats some sections under several topics: split by topic, a passage could fall in both)."""
    parity = 0 if half == "calibration" else 1
    every = dict.fromkeys(read_passages((CORPUS,)))  # distinct, in order
    return tuple(p for p in every if hashlib.sha256(p.encode()).digest()[0] % 2 == parity)


def _split(text: str) -> list[str]:
    out: list[str] = []
    current = ""
    for paragraph in (p.strip("\n") for p in re.split(r"\n\s*\n", text)):
        if not paragraph.strip():
            continue
        for piece in _cut(paragraph):
            joined = f"{current}\n\n{piece}" if current else piece
            if len(joined) > _LONGEST and current:
                _close(out, current)
                joined = piece
            current = joined
            if len(current) >= _SHORTEST:
                out.append(current)
                current = ""
    if current:
        _close(out, current)
    return out


def _close(out: list[str], passage: str) -> None:
    """Keep ``passage``; a short one joins the passage before it rather than stand alone."""
    if len(passage) < _SHORTEST // 2 and out:
        out[-1] = f"{out[-1]}\n\n{passage}"
    else:
        out.append(passage)


def _cut(paragraph: str) -> list[str]:
    """A paragraph longer than `_LONGEST` cut at line ends (at a hard limit where a line is longer)."""
    pieces, current = [], ""
    for line in paragraph.split("\n"):
        while len(line) > _LONGEST:
            pieces.append(line[:_LONGEST])
            line = line[_LONGEST:]
        if current and len(current) + 1 + len(line) > _LONGEST:
            pieces.append(current)
            current = line
        else:
            current = f"{current}\n{line}" if current else line
    return [*pieces, current] if current else pieces
