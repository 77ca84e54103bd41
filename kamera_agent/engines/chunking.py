"""A request's tokens cut into chunks as a window cuts what it is given: engine-neutral.

A window's image chunk is the image framed as the chat template frames it (vision start,
placeholders, vision end) and each conversation message is a chunk of its own. In a request an
engine has, that is: each image's placeholder span (the engine says where: SGLang by its
content-derived pad values, vLLM by its ``mm_features``) with the framing token on each side,
and text cut before each message's opening marker. The marker is read off the tokenizer's own
chat template (`message_starts`): ChatML's ``<|im_start|>``, Llama 3's
``<|start_header_id|>``, Gemma's ``<start_of_turn>``, Mistral's ``[INST]``. A chunk's key is
its tokens (an image's: its content identity) scoped by the request's anchor (its first chunk,
keyed in the request's namespace: `keyed`), so the same image or message behind the same
system prompt has the same key wherever it sits, the key a conversation window gives the same
message, and another tenant's never does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kamera_agent.chunks.chunk import token_key
from kamera_agent.engines.load_plan import RequestChunk

__all__ = ["ChunkRules", "ImageSpan", "keyed", "message_starts", "request_chunks"]

_SENTINELS = tuple(f"\u2063KAMERA_M{i}\u2063" for i in range(4))


@dataclass(frozen=True)
class ChunkRules:
    """How a request's tokens are cut into chunks.

    Attributes:
        image_open / image_close: the tokens framing an image's placeholders (Qwen-VL:
            ``<|vision_start|>`` / ``<|vision_end|>``); ``None``: the span alone.
        message_starts: the tokens opening a message (``<|im_start|>``); empty: text runs are
            not cut.
    """

    image_open: int | None = None
    image_close: int | None = None
    message_starts: frozenset[int] = frozenset()

    @classmethod
    def for_model(cls, config: Any, tokenizer: Any | None = None) -> ChunkRules:
        """The rules of a model: framing tokens from its config (``vision_start_token_id``,
        ``vision_end_token_id``), the message markers from its tokenizer's chat template."""
        return cls(
            image_open=getattr(config, "vision_start_token_id", None),
            image_close=getattr(config, "vision_end_token_id", None),
            message_starts=message_starts(tokenizer) if tokenizer is not None else frozenset(),
        )


def message_starts(tokenizer: Any) -> frozenset[int]:
    """The special tokens that open a message in the tokenizer's chat template.

    Read off the template: a user / assistant / user / assistant conversation is rendered around
    sentinels, and between each message and the next the first special token after the
    previous message's own closing token is the next one's opening (``<|im_end|>\\n
    <|im_start|>`` gives ``<|im_start|>``; Llama 3's ``<|eot_id|><|start_header_id|>`` gives
    ``<|start_header_id|>``). A template with no special marker there (Mistral's assistant turn,
    which only ``[/INST]`` ends) cuts where it has one. No template, one that cannot render
    this conversation, or none found: ChatML's ``<|im_start|>`` if the vocabulary has it, else
    no cuts (a request is then one chunk, which nothing but a prefix cache can reuse).
    """
    found: set[int] = set()
    if getattr(tokenizer, "chat_template", None):
        roles = ("user", "assistant", "user", "assistant")
        messages = [{"role": role, "content": text} for role, text in zip(roles, _SENTINELS, strict=True)]
        try:
            rendered = str(tokenizer.apply_chat_template(messages, tokenize=False))
        except Exception:  # a template may refuse any shape it does not know: fall back
            rendered = ""
        special = set(getattr(tokenizer, "all_special_ids", ()))
        special |= {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
        for before, after in itertools.pairwise(_SENTINELS):
            a, b = rendered.find(before), rendered.find(after)
            if a < 0 or b < 0:
                continue
            between = tokenizer(rendered[a + len(before) : b], add_special_tokens=False)["input_ids"]
            closer = 1 if between and between[0] in special else 0
            found |= {next((i for i in between[closer:] if i in special), -1)} - {-1}
    if not found:
        token = tokenizer.convert_tokens_to_ids("<|im_start|>") if tokenizer is not None else None
        known = isinstance(token, int) and token != getattr(tokenizer, "unk_token_id", None)
        found = {token} if known and isinstance(token, int) else set()
    return frozenset(found)


@dataclass(frozen=True)
class ImageSpan:
    """``tokens[start:end]`` hold one image's placeholders; ``identity`` names its content."""

    start: int
    end: int
    identity: str


def request_chunks(
    tokens: Sequence[int], images: Sequence[ImageSpan], rules: ChunkRules, namespace: str = ""
) -> list[RequestChunk]:
    """A request's chunks, left to right, covering ``tokens`` exactly, keyed by content."""
    bounds: list[tuple[int, int, str]] = []
    cursor = 0
    for image in sorted(images, key=lambda span: span.start):
        start, end = image.start, image.end
        if rules.image_open is not None and start > cursor and tokens[start - 1] == rules.image_open:
            start -= 1
        if rules.image_close is not None and end < len(tokens) and tokens[end] == rules.image_close:
            end += 1
        bounds += _text(tokens, cursor, start, rules)
        bounds.append((start, end, f"image:{image.identity}"))
        cursor = end
    bounds += _text(tokens, cursor, len(tokens), rules)
    return keyed(tokens, bounds, namespace)


def keyed(
    tokens: Sequence[int], bounds: Sequence[tuple[int, int, str]], namespace: str = ""
) -> list[RequestChunk]:
    """Chunks ``tokens[a:b]`` of the given kinds with their content keys (`token_key`): the first
    (the request's anchor) keyed in ``namespace``, every later one scoped by the anchor's key."""
    out: list[RequestChunk] = []
    for a, b, kind in bounds:
        scope = out[0].key if out else namespace
        out.append(RequestChunk(a, b, token_key(scope, kind, tokens[a:b])))
    return out


def _text(tokens: Sequence[int], start: int, end: int, rules: ChunkRules) -> list[tuple[int, int, str]]:
    cuts = [start]
    for token in rules.message_starts:  # found by the sequence's own search (a C scan for a list)
        cuts += _positions(tokens, token, start + 1, end)
    cuts.sort()
    return [(a, b, "text") for a, b in zip(cuts, [*cuts[1:], end], strict=True) if a < b]


def _positions(tokens: Sequence[int], token: int, start: int, end: int) -> list[int]:
    """Every index of ``token`` in ``tokens[start:end]``."""
    out, at = [], start
    while at < end:
        try:
            at = tokens.index(token, at, end)
        except ValueError:
            break
        out.append(at)
        at += 1
    return out
