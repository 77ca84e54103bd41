"""A request's turns as the chunks a conversation window holds, prepared outside the model lock.

Why here and cached: preparing a message (fetching and decoding its images, the image
processor, tokenizing, hashing pixels into content keys) is most of a request's own work, and
a conversation re-sends every earlier message each turn. Chunks depend only on the system
prompt (the anchor every canonical is computed behind), the message's role and parts, and how
the message is framed (closed, or left open for the question), so they are kept by that key
within a byte limit (and each system prompt's framing within another: never by count, since a
stranger decides how large each is): a turn prepares only the messages it has not sent before,
and none of it holds the model lock.

Each tenant's chunks are keyed in its namespace (the ``cache_salt`` its windows have), so
everything here is kept per namespace too: framings, chunks, and the decoded images behind them
(a tenant never gets another's image faster because that tenant sent it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from kamera_agent.backends.base import Backend
from kamera_agent.chunks.chat import ChatTemplate
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.errors import KameraError
from kamera_agent.serve.lru import ByteLRU
from kamera_agent.serve.pixels import PixelLease
from kamera_agent.serve.protocol import RequestError
from kamera_agent.serve.turns import ImageReader, Turn
from kamera_agent.window.conversation import Conversation

__all__ = ["Framing", "MessageChunks", "Prepared"]


@dataclass(frozen=True)
class Prepared:
    """What a request asks of its window: the chunks it holds (every message, the last one open:
    the question's framing closes it), the last message's role (``user``, or ``tool``: an
    agent's turn ends in a tool's output), and the opening of the answer (a final assistant
    message the answer continues; ``""``: none).

    Why the last message is chunks, not the question's text: the next turn resends it as
    history, and finds it in the window (a question's KV is dropped after its answer)."""

    chunks: tuple[Chunk, ...]
    role: str = "user"
    answer_start: str = ""


@dataclass(frozen=True)
class Framing:
    """A conversation's framing under one system prompt, and its anchor's length in tokens."""

    conversation: Conversation
    anchor_tokens: int


class MessageChunks:
    """Chunks of messages for one backend, by system prompt and message, within byte limits.

    Thread-safe (requests are prepared concurrently).

    Args:
        backend: the engine (its default encoder: tokenizer, image processor, chat template).
        images: reads and decodes image parts.
        limit: bytes of chunks (token ids and preprocessed pixels) kept.
        max_pixels: images larger than this are refused before decoding.
        anchor_limit: bytes of conversation framings (each a system prompt's anchor) kept.
    """

    def __init__(
        self,
        backend: Backend,
        images: ImageReader,
        limit: int = 128 << 20,
        max_pixels: int = 0,
        anchor_limit: int = 16 << 20,
    ) -> None:
        self.backend, self.images = backend, images
        self.max_pixels = max_pixels or images.max_pixels
        encoder = backend.encoder
        self.template = ChatTemplate.from_tokenizer(encoder.tokenizer, encoder.prompt)
        self._conversations: ByteLRU[tuple[str | None, str | None], Framing] = ByteLRU(
            anchor_limit, _framing_bytes
        )
        self._chunks: ByteLRU[tuple[str, str, bool, int], tuple[Chunk, ...]] = ByteLRU(limit, _chunks_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes of chunks held now."""
        return self._chunks.nbytes

    @property
    def anchor_nbytes(self) -> int:
        """Bytes of conversation framings held now."""
        return self._conversations.nbytes

    def conversation(self, system: str | None, salt: str | None = None) -> Conversation:
        """The framing of a conversation under ``system`` (`framing`), without its anchor's length."""
        return self.framing(system, salt).conversation

    def framing(self, system: str | None, salt: str | None = None) -> Framing:
        """The framing of a conversation under ``system`` (its own encoder and anchor), as the
        window of that conversation frames it (`KameraWindow` with ``cache_salt=salt``), and how
        many tokens its anchor takes (one kept only if it fits).

        Raises:
            RequestError: the system prompt alone does not fit the model's context.
        """
        known = self._conversations.get((salt, system))
        if known is not None:
            return known
        encoder = self.backend.encoder
        if salt is not None:  # as KameraWindow keys a salted window's chunks: in "|<salt>"
            encoder = encoder.in_namespace(f"|{salt}")
        encoder = encoder.with_prompt(self.template.prompt_format(system))
        made = Framing(Conversation(self.template, encoder, self.max_pixels), encoder.anchor().num_tokens)
        limit = self.backend.context_limit
        if limit is not None and made.anchor_tokens >= limit:
            raise RequestError(
                400,
                f"the system prompt alone is {made.anchor_tokens} tokens; the model has {limit}: shorten it",
                param="messages",
                code="context_length_exceeded",
            )
        self._conversations.put((salt, system), made)
        return made

    def prepare(
        self, system: str | None, turns: list[Turn], lease: PixelLease, salt: str | None = None
    ) -> Prepared:
        """Every message as chunks, the last (user or tool) one open (the question's framing
        closes it), keyed in the namespace of ``salt``; a final assistant message after it
        (`read_turns` lets one through for ``continue_final_message``) is the answer's opening.
        Images decoded here are charged to ``lease``.

        Raises:
            RequestError: an image that cannot be read (or not now: 429), or content that cannot
                become a chunk.
        """
        conversation = self.conversation(system, salt)
        separator = conversation.template.part_separator
        answer_start = ""
        if turns[-1].role == "assistant":
            answer_start = separator.join(str(part) for part in turns[-1].parts)
            turns = turns[:-1]
        chunks: list[Chunk] = []
        for i, turn in enumerate(turns[:-1]):
            where = f"messages[{i}]"
            chunks += self._message(conversation, turn, where, len(turn.parts), lease, closed=True)
        where, last = f"messages[{len(turns) - 1}]", turns[-1]
        chunks += self._message(conversation, last, where, len(last.parts), lease, closed=False)
        return Prepared(tuple(chunks), last.role, answer_start)

    def _message(
        self,
        conversation: Conversation,
        turn: Turn,
        where: str,
        count: int,
        lease: PixelLease,
        *,
        closed: bool,
    ) -> list[Chunk]:
        labels = [f"{where}.{j}" for j in range(count)]
        key = (conversation.encoder.origin, turn.digest, closed, count)
        known = self._chunks.get(key)
        if known is not None:  # labelled "<where>.<part, marker or separator>" by the message that made them
            return [replace(chunk, label=f"{where}.{str(chunk.label).partition('.')[2]}") for chunk in known]
        scope = conversation.encoder.namespace
        parts = [
            part if isinstance(part, str) else self.images.read(part, lease, scope) for part in turn.parts
        ]
        try:
            made = conversation.message(turn.role, parts, closed=closed, labels=labels, markers_apart=True)
        except KameraError as exc:  # bad content, or an image the model cannot take
            raise RequestError(400, f"{where}: {exc}", param="messages") from exc
        self._chunks.put(key, tuple(made))
        return made


def _chunks_bytes(chunks: tuple[Chunk, ...]) -> int:
    tensors = [
        tensor
        for chunk in chunks
        for tensor in (chunk.input_ids, chunk.relative_positions, chunk.mm_token_type_ids, chunk.pixel_values)
    ]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _framing_bytes(framing: Framing) -> int:
    """A framing's bytes: its anchor text, and the system prompt it is kept under (as large)."""
    return 2 * sys.getsizeof(framing.conversation.encoder.prompt.anchor) + 4096
