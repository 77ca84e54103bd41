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
from typing import Literal

from kamera_agent.engines.chunking import ChunkRules, ImageSpan
from kamera_agent.engines.chunking import request_chunks as chunk_request
from kamera_agent.engines.load_plan import RequestChunk

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


def request_chunks(tokens: Sequence[int], rules: ChunkRules, namespace: str = "") -> list[RequestChunk]:
    """A request's chunks (`kamera_agent.engines.chunking`), its images found by SGLang's pad values
    (an image's identity: its distinct pad values, derived from its content hash alone)."""
    runs = [s for s in segment_key(tokens) if s.kind == "image"]
    images = [ImageSpan(s.start, s.end, ",".join(map(str, s.pads))) for s in runs]
    return chunk_request(tokens, images, rules, namespace)
