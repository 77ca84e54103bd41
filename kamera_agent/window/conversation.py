"""Chat messages as window chunks: each message frames itself with its role's markers.

Why a separate piece the window holds: a plain window is one user turn (its chunks are that
turn's parts, its query closes it); a conversation window frames every message as the chat
template does (`ChatTemplate`), so the window can hold many turns, replies included, and a
message is the same chunks wherever it sits. The window delegates framing here and keeps its
ops; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kamera_agent.chunks.chat import ROLES, ChatTemplate
from kamera_agent.chunks.chunk import Chunk, ChunkKind
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.chunks.sources import MAX_IMAGE_PIXELS, VideoFrame
from kamera_agent.errors import InputError

__all__ = ["Conversation", "MessagePart"]

MessagePart = Any
"""A message part: text (``str``), or an image (PIL image, path, array, `VideoFrame`)."""


class Conversation:
    """Frames messages for one conversation window.

    Args:
        template: the chat template's pieces.
        encoder: the window's encoder (its anchor holds the system prompt).
    """

    def __init__(
        self, template: ChatTemplate, encoder: ChunkEncoder, max_pixels: int = MAX_IMAGE_PIXELS
    ) -> None:
        self.template = template
        self.encoder = encoder
        self.max_pixels = max_pixels

    def message(
        self,
        role: str,
        parts: Sequence[MessagePart],
        *,
        opened: bool = True,
        closed: bool = True,
        labels: Sequence[str | None] | None = None,
        markers_apart: bool = False,
    ) -> list[Chunk]:
        """The chunks of one message, a chunk per part: the first carries the role's opening
        marker (unless ``opened`` is false: the message was begun by earlier chunks), the last its
        closing one (unless ``closed`` is false: the query will close it).

        ``markers_apart``: the markers are chunks of their own (labelled ``open`` and
        ``close``), and so is the separator between two parts where the template has one (a
        string-content template's newline, labelled ``sep<i>`` before part ``i``; where the
        tokenizer gives it apart the tokens it gives it joined: `ChatTemplate.separator_apart`),
        so every part's chunk is the same whichever parts the message keeps: an agent that
        drops a screenshot from an old message (its text kept) evicts that chunk and a
        separator, and the message's other chunks stay where they are. The token sequence is
        the same either way.

        Raises:
            InputError: an unknown role, or a message with no parts.
        """
        if role not in ROLES:
            raise InputError(
                f"role {role!r} cannot be a chunk; use one of {', '.join(ROLES)} (the system prompt is "
                "the window's anchor)"
            )
        if not parts:
            raise InputError(f"a {role} message needs at least one part (text or an image)")
        t = self.template
        chunks = []
        if markers_apart and opened:
            chunks.append(self.encoder.text(t.opens[role], label=_marker(labels, "open")))
        separators_apart = markers_apart and t.separator_apart
        for i, part in enumerate(parts):
            first, last = i == 0, i == len(parts) - 1
            if separators_apart and not first:
                chunks.append(self.encoder.text(t.part_separator, label=_marker(labels, f"sep{i}")))
                before = ""
            elif first:
                before = "" if markers_apart or not opened else t.opens[role]
            else:
                before = t.part_separator
            after = t.closes[role] if closed and last and not markers_apart else ""
            label = labels[i] if labels is not None else None
            chunks.append(self._part(part, before, after, label))
        if markers_apart and closed:
            chunks.append(self.encoder.text(t.closes[role], label=_marker(labels, "close")))
        return chunks

    def query_ids(
        self, text: str, *, opened: bool = True, role: str = "user", answer_start: str = ""
    ) -> torch.Tensor:
        """The query as the conversation's last message: its text (after the role's opening
        marker unless chunks already began the message), the closing marker, then the
        assistant's opening and ``answer_start`` (the opening of the answer the model continues).
        ``role`` is ``user`` for a question, ``tool`` for an agent's turn that ends in a tool's
        output (the model answers the output).

        Raises:
            InputError: a role that cannot end a conversation (``assistant``, or unknown).
        """
        if role not in ("user", "tool"):
            raise InputError(f"a question is a user or a tool message, not {str(role)[:40]!r}")
        t = self.template
        before = t.opens[role] if opened else t.part_separator if text else ""
        return self.encoder.tokens(before + text + t.closes[role] + t.generation + answer_start)

    def _part(self, part: MessagePart, before: str, after: str, label: str | None) -> Chunk:
        if isinstance(part, Chunk):
            raise InputError("a message part is text or an image; a prepared Chunk has its framing already")
        if isinstance(part, str):
            return self.encoder.text(before + part + after, label=label)
        kind: ChunkKind = "frame" if isinstance(part, VideoFrame) else "image"
        image = part.image if isinstance(part, VideoFrame) else part
        return self.encoder.image(
            image, kind=kind, caption=before, trailer=after, label=label, max_pixels=self.max_pixels
        )


def _marker(labels: Sequence[str | None] | None, which: str) -> str | None:
    """A marker chunk's label: the message's first label's stem and ``which``."""
    if not labels or labels[0] is None:
        return None
    return labels[0].rpartition(".")[0] + f".{which}" if "." in labels[0] else f"{labels[0]}.{which}"
