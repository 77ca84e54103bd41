"""A request's turns as the chunks a conversation window holds, prepared outside the model lock.

Why here and cached: preparing a message (fetching and decoding its images, the image
processor, tokenizing, hashing pixels into content keys) is most of a request's own work, and
a conversation re-sends every earlier message each turn. Chunks depend only on the system
prompt (the anchor every canonical is computed behind), the message's role and parts, and how
the message is framed (closed, or left open for the question), so they are kept by that key
within a byte budget: a turn prepares only the messages it has not sent before, and none of it
holds the model lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

from kamera_agent.backends.base import Backend
from kamera_agent.chunks.chat import ChatTemplate
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.errors import InputError
from kamera_agent.serve.protocol import RequestError
from kamera_agent.serve.turns import ImageReader, Turn
from kamera_agent.window.conversation import Conversation

__all__ = ["MessageChunks", "Prepared"]


@dataclass(frozen=True)
class Prepared:
    """What a request asks of its window: the chunks it holds (every message but the question),
    the question text, whether the question ends a message its images opened, and the
    question's role (``user``, or ``tool``: an agent's turn ends in a tool's output)."""

    chunks: tuple[Chunk, ...]
    query: str
    in_message: bool
    role: str = "user"


class MessageChunks:
    """Chunks of messages for one backend, by system prompt and message, within a byte budget.

    Thread-safe (requests are prepared concurrently).

    Args:
        backend: the engine (its default encoder: tokenizer, image processor, chat template).
        images: reads and decodes image parts.
        budget: bytes of chunks (token ids and preprocessed pixels) kept.
        max_pixels: images larger than this are refused before decoding.
    """

    def __init__(
        self, backend: Backend, images: ImageReader, budget: int = 128 << 20, max_pixels: int = 0
    ) -> None:
        self.backend, self.images, self.budget = backend, images, budget
        self.max_pixels = max_pixels or images.max_pixels
        encoder = backend.encoder
        self.template = ChatTemplate.from_tokenizer(encoder.tokenizer, encoder.prompt)
        self._conversations: OrderedDict[str | None, Conversation] = OrderedDict()
        self._chunks: OrderedDict[tuple[str, str, bool, int], tuple[Chunk, ...]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of chunks held now."""
        return self._bytes

    def conversation(self, system: str | None) -> Conversation:
        """The framing of a conversation under ``system`` (its own encoder and anchor), as the
        window of that conversation frames it."""
        with self._lock:
            known = self._conversations.get(system)
            if known is not None:
                self._conversations.move_to_end(system)
                return known
        encoder = self.backend.encoder.with_prompt(self.template.prompt_format(system))
        made = Conversation(self.template, encoder, self.max_pixels)
        with self._lock:
            self._conversations[system] = made
            while len(self._conversations) > 64:
                self._conversations.popitem(last=False)
        return made

    def prepare(self, system: str | None, turns: list[Turn]) -> Prepared:
        """Every message but the last as chunks, then the last (user or tool) message's leading
        parts (images) as an open message, its trailing text as the question.

        Raises:
            RequestError: an image that cannot be read, or content that cannot become a chunk.
        """
        conversation = self.conversation(system)
        chunks: list[Chunk] = []
        for i, turn in enumerate(turns[:-1]):
            chunks += self._message(conversation, turn, f"messages[{i}]", len(turn.parts), closed=True)
        last = list(turns[-1].parts)
        tail: list[str] = []
        while last and isinstance(last[-1], str):
            tail.insert(0, str(last.pop()))
        query = conversation.template.part_separator.join(tail)
        if last:
            opened = Turn(turns[-1].role, tuple(last), turns[-1].digest)
            chunks += self._message(
                conversation, opened, f"messages[{len(turns) - 1}]", len(last), closed=False
            )
        return Prepared(tuple(chunks), query, bool(last), turns[-1].role)

    def _message(
        self, conversation: Conversation, turn: Turn, where: str, count: int, *, closed: bool
    ) -> list[Chunk]:
        labels = [f"{where}.{j}" for j in range(count)]
        every = [f"{where}.open", *labels, *([f"{where}.close"] if closed else [])]  # markers apart
        key = (conversation.encoder.origin, turn.digest, closed, count)
        with self._lock:
            known = self._chunks.get(key)
            if known is not None:
                self._chunks.move_to_end(key)
                return [replace(chunk, label=label) for chunk, label in zip(known, every, strict=True)]
        parts = [part if isinstance(part, str) else self.images.read(part) for part in turn.parts]
        try:
            made = conversation.message(turn.role, parts, closed=closed, labels=labels, markers_apart=True)
        except InputError as exc:
            raise RequestError(400, f"{where}: {exc}", param="messages") from exc
        self._keep(key, tuple(made))
        return made

    def _keep(self, key: tuple[str, str, bool, int], chunks: tuple[Chunk, ...]) -> None:
        size = sum(_nbytes(chunk) for chunk in chunks)
        if size > self.budget:
            return
        with self._lock:
            if key in self._chunks:
                return
            self._chunks[key] = chunks
            self._bytes += size
            while self._bytes > self.budget:
                _, old = self._chunks.popitem(last=False)
                self._bytes -= sum(_nbytes(chunk) for chunk in old)


def _nbytes(chunk: Chunk) -> int:
    tensors = [chunk.input_ids, chunk.relative_positions, chunk.mm_token_type_ids, chunk.pixel_values]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
