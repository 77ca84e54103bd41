"""What a replayed agent sees each step: a screen, the action it took, the tool's output.

Why three kinds: the shipped demo VLM reads real screens (the demo task's rendered pages, sent
as PNG data URLs, 96 image tokens each), and its answers mean something; the 1.5B-class random
shape is text-only, so a screen is a line of random letters of a screenshot's token count (its
byte tokenizer makes a character a token): wall time on a shape depends on token counts only.
A real text model reads screens as an agent serving it sends them, accessibility trees of
300-800 tokens, and tool outputs of 200-2,000 tokens of real text (`TreeScreens`). All are
deterministic in the step index, so every side sees the same conversation.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass
from typing import Any, Protocol

from kamera_agent.bench.agents.text_contents import TextContents
from kamera_agent.demo.task import BLANK, make_items, render_page

__all__ = ["DemoScreens", "Screens", "TextScreens", "TreeScreens"]

_ACTIONS = ("click", "type", "scroll", "open", "read", "back", "search", "select")


class Screens(Protocol):
    """The ``step``-th screen as a message part, action text and tool output."""

    def screen(self, step: int) -> dict[str, Any]: ...

    def action(self, step: int) -> str: ...

    def output(self, step: int) -> str: ...


@dataclass
class DemoScreens:
    """The demo task's pages as screenshots (PNG data URLs), short actions and outputs."""

    seed: int

    def __post_init__(self) -> None:
        self._pages = [page for item in make_items(12, self.seed) for page in item.pages]
        self._urls: dict[int, str] = {}

    def screen(self, step: int) -> dict[str, Any]:
        if step not in self._urls:
            buffer = io.BytesIO()
            render_page(self._pages[step % len(self._pages)]).save(buffer, format="PNG")
            self._urls[step] = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        return {"type": "image_url", "image_url": {"url": self._urls[step]}}

    def action(self, step: int) -> str:
        return f"{_ACTIONS[step % len(_ACTIONS)]} #{step % 9 + 1}"

    def output(self, step: int) -> str:
        glyphs = "".join(cell for cell in self._pages[step % len(self._pages)] if cell != BLANK)
        return f"page {step}: {glyphs} " * 3


@dataclass
class TextScreens:
    """Random-letter screens of ``screen_tokens`` characters (a token each) for a text model."""

    seed: int
    screen_tokens: int = 48
    output_tokens: int = 48

    def _letters(self, kind: str, step: int, count: int) -> str:
        rng = random.Random(f"{self.seed}:{kind}:{step}")
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(count))

    def screen(self, step: int) -> dict[str, Any]:
        return {"type": "text", "text": self._letters("screen", step, self.screen_tokens)}

    def action(self, step: int) -> str:
        return f"{_ACTIONS[step % len(_ACTIONS)]} #{step % 9 + 1}"

    def output(self, step: int) -> str:
        return self._letters("output", step, self.output_tokens)


@dataclass
class TreeScreens:
    """A real text model's screens: accessibility-tree text (the agents suite's screenshots),
    transcript actions, and tool outputs of real text, at their lengths in the model's tokens.

    Args:
        contents: the agents suite's text contents over the served model's encoder.
    """

    contents: TextContents

    def screen(self, step: int) -> dict[str, Any]:
        return {"type": "text", "text": self.contents.text("screenshot", step)}

    def action(self, step: int) -> str:
        return self.contents.text("line", step).strip()

    def output(self, step: int) -> str:
        return self.contents.text("item", step)
