"""A request's token key as SGLang's scheduler sees it, cut into image runs and text runs.

Why this works without client hints: SGLang replaces every image's placeholder tokens by pad
values derived from the image's content hash alone (``MM_PAD_SHIFT_VALUE`` plus wide sentinels,
``schedule_batch._compute_pad_values``), so the same image carries the same pad values wherever
it sits in any request, and no text token can take them (they lie above the vocabulary). An
image run is a maximal run of such values; its pad values are the image's identity; the text
between two runs is a text run. (Qwen-VL templates frame every image with vision start/end
tokens, so two images are never adjacent.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kamera_agent.core.synthesis import RequestChunk, chunk_key

__all__ = ["MM_PAD_SHIFT_VALUE", "ChunkRules", "Segment", "request_chunks", "segment_key"]

MM_PAD_SHIFT_VALUE = 1_000_000
"""SGLang 0.5.23's base of multimodal pad values (``schedule_batch.MM_PAD_SHIFT_VALUE``); the
tests check it against the installed SGLang."""


@dataclass(frozen=True)
class Segment:
    """``key[start:end]``: a text run, or one image's placeholder run.

    Attributes:
        kind: ``"text"`` or ``"image"``.
        start / end: the run's slice of the key.
        pads: an image's distinct pad values in order of first appearance (its identity);
            ``()`` for text.
    """

    kind: Literal["text", "image"]
    start: int
    end: int
    pads: tuple[int, ...] = ()

    def __len__(self) -> int:
        return self.end - self.start


def segment_key(key: Sequence[int], pad_shift: int = MM_PAD_SHIFT_VALUE) -> list[Segment]:
    """The key's runs, left to right, covering it exactly."""
    segments: list[Segment] = []
    start = 0
    while start < len(key):
        image = key[start] >= pad_shift
        end = start + 1
        while end < len(key) and (key[end] >= pad_shift) == image:
            end += 1
        if image:
            pads = tuple(dict.fromkeys(key[start:end]))
            segments.append(Segment("image", start, end, pads))
        else:
            segments.append(Segment("text", start, end))
        start = end
    return segments


@dataclass(frozen=True)
class ChunkRules:
    """How a request's tokens are cut into chunks, as a window cuts what it is given.

    A window's image chunk is the image framed as the chat template frames it (vision start,
    placeholders, vision end) and each conversation message is a chunk of its own; in a
    request that is: an image run with the framing token on each side, and text cut before
    each message's opening marker.

    Attributes:
        image_open / image_close: the tokens framing an image's placeholders (Qwen-VL:
            ``<|vision_start|>`` / ``<|vision_end|>``); ``None``: the run alone.
        message_start: the token opening each message (``<|im_start|>``); ``None``: text runs
            are not cut.
        pad_shift: the base of SGLang's multimodal pad values.
    """

    image_open: int | None = None
    image_close: int | None = None
    message_start: int | None = None
    pad_shift: int = MM_PAD_SHIFT_VALUE

    @classmethod
    def for_model(cls, config: Any, tokenizer: Any | None = None) -> ChunkRules:
        """The rules of a model: framing tokens from its config (``vision_start_token_id``,
        ``vision_end_token_id``), the message marker from its tokenizer (``<|im_start|>``)."""
        start = None
        if tokenizer is not None:
            token = tokenizer.convert_tokens_to_ids("<|im_start|>")
            start = (
                token
                if isinstance(token, int) and token != getattr(tokenizer, "unk_token_id", None)
                else None
            )
        return cls(
            image_open=getattr(config, "vision_start_token_id", None),
            image_close=getattr(config, "vision_end_token_id", None),
            message_start=start,
        )


def request_chunks(tokens: Sequence[int], rules: ChunkRules, namespace: str = "") -> list[RequestChunk]:
    """A request's chunks, left to right, covering ``tokens`` exactly, keyed by content."""
    bounds: list[tuple[int, int, str]] = []
    for segment in segment_key(tokens, rules.pad_shift):
        if segment.kind == "image":
            start, end = segment.start, segment.end
            if rules.image_open is not None and start > 0 and tokens[start - 1] == rules.image_open:
                start -= 1
            if rules.image_close is not None and end < len(tokens) and tokens[end] == rules.image_close:
                end += 1
            if bounds and bounds[-1][1] > start:  # the framing token leaves the text run before it
                prev = bounds.pop()
                if prev[0] < start:
                    bounds.append((prev[0], start, "text"))
            bounds.append((start, end, "image"))
            continue
        start = max(segment.start, bounds[-1][1] if bounds else 0)
        cuts = [start]
        if rules.message_start is not None:
            cuts += [i for i in range(start + 1, segment.end) if tokens[i] == rules.message_start]
        for a, b in zip(cuts, [*cuts[1:], segment.end], strict=True):
            if a < b:
                bounds.append((a, b, "text"))
    return [RequestChunk(a, b, chunk_key(namespace, kind, tokens[a:b])) for a, b, kind in bounds]
