"""The chunk: one unit of content an agent admits, exactly as the model will see it.

Why a separate, model-prepared object: a chunk's identity (its content key) must be a hash
of what the model sees, token ids and preprocessed pixels, plus the model's fingerprint, so
the same frame hits the store at any position, in any request, and a chunk prepared for one
model is never served to another. Its positional layout is part of it too: with M-RoPE an
image of ``h x w`` merged patches occupies ``n`` cache slots but advances the position by
``max(h, w)`` only, so *position is not the cache slot*.

Worked example (Qwen2-VL, an image of 2 x 3 merged patches behind ``<|vision_start|>``):

=========  ===============  ===============  ================  ==============
slot        token            t               h                 w
=========  ===============  ===============  ================  ==============
0          vision_start     0               0                 0
1..6       image_pad × 6    1, 1, 1, 1,…    1, 1, 1, 2, 2, 2  1, 2, 3, 1, 2, 3
7          vision_end       4               4                 4
=========  ===============  ===============  ================  ==============

``relative_positions`` holds these rows; placed at start ``s`` the chunk sits at
``s + relative_positions`` and the next chunk starts at ``s + advance`` (here 5).
"""

from __future__ import annotations

import functools
import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

__all__ = ["Chunk", "ChunkKind", "content_key", "image_identity", "token_key"]

ChunkKind = Literal["image", "frame", "screenshot", "page", "text", "anchor"]


@dataclass(frozen=True, eq=False)
class Chunk:
    """A model-ready chunk.

    Attributes:
        kind: what the agent admitted (image, frame, screenshot, page, text, anchor).
        key: content key (see `content_key`).
        input_ids: ``[n]`` token ids, vision placeholders included.
        relative_positions: ``[n]`` (1-D RoPE) or ``[3, n]`` (M-RoPE t, h, w) from the chunk start.
        advance: how far the position moves past this chunk.
        mm_token_type_ids: ``[n]`` 0 for text, 1 for image tokens.
        pixel_values: preprocessed pixels for the vision tower; ``None`` for text, and for an
            image whose pixels were released once its vision output or KV was stored.
        image_grid_thw: ``[1, 3]`` patch grid for the vision tower, or ``None``.
        vision_key: content key of the pixels alone (the vision-embedding cache key).
        label: the caller's name for the chunk, if any.
        meta: source details (file, frame index, timestamp, page number).
        origin: digest of the model fingerprint and processing settings it was prepared for
            (part of ``key`` too): a backend checks it with a string compare, not a re-hash.
    """

    kind: ChunkKind
    key: str
    input_ids: torch.Tensor
    relative_positions: torch.Tensor
    advance: int
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    vision_key: str | None = None
    label: str | None = None
    meta: dict[str, str] = field(default_factory=dict)
    origin: str = ""

    def __repr__(self) -> str:
        name = f" {self.label!r}" if self.label else ""
        pixels = "" if not self.has_vision else (", pixels" if self.has_pixels else ", pixels released")
        return f"Chunk({self.kind}{name}, {self.num_tokens} tokens{pixels}, key {self.key[:12]}…)"

    @functools.cached_property
    def num_tokens(self) -> int:  # read a few dozen times an op: once from the tensor
        return int(self.input_ids.shape[0])

    @property
    def has_vision(self) -> bool:
        """The chunk holds image tokens, filled by a vision tower's output."""
        return self.vision_key is not None

    @property
    def has_pixels(self) -> bool:
        """Its pixels are still held (the vision tower can run on them)."""
        return self.pixel_values is not None

    def without_pixels(self) -> Chunk:
        """The same chunk without its pixels: what an evicted image keeps once its vision output
        or canonical is stored (pixels are the largest part of a chunk)."""
        return replace(self, pixel_values=None)

    def positions_at(self, start: int) -> torch.Tensor:
        """Absolute positions ``[n]`` or ``[3, n]`` when the chunk starts at ``start``."""
        return self.relative_positions + start


def content_key(*parts: bytes | str | torch.Tensor | None) -> str:
    """SHA-256 over the parts in order; tensors contribute dtype, shape and raw bytes."""
    digest = hashlib.sha256()
    for part in parts:
        if part is None:
            digest.update(b"\x00none")
        elif isinstance(part, torch.Tensor):
            tensor = part.detach().to("cpu").contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        elif isinstance(part, str):
            digest.update(part.encode())
        else:
            digest.update(part)
        digest.update(b"\x1f")
    return digest.hexdigest()


def token_key(scope: str, kind: str, tokens: Sequence[int] | torch.Tensor) -> str:
    """The content key of a span of tokens, the same for a window and an engine adapter.

    Why one function: a window's text chunk and an engine request's chunk of the same tokens
    must find the same store entries (a conversation a window held is then served to an engine,
    and the reverse). Only tokens and scope enter: the model is the store's (every entry carries
    its fingerprint), and a chunk's canonical depends on what it is computed behind, so the
    scope is the anchor's key for every chunk after it, and ``""`` or a tenant's namespace for
    the anchor itself (see `kamera_agent.engines.chunking`).

    Args:
        scope: the anchor's key (or, for an anchor, the namespace).
        kind: ``"text"``, or an engine's ``"image:<identity>"`` for an image span.
        tokens: the span's token ids.
    """
    if isinstance(tokens, torch.Tensor):
        packed = tokens.detach().to("cpu", torch.int64).numpy().astype("<i8", copy=False).tobytes()
    else:  # the ids as little-endian int64s: packing bytes does no per-id string formatting, and
        # an engine keys every prompt's chunks on its step
        packed = array("q", tokens).tobytes() if sys.byteorder == "little" else _swapped(tokens)
    digest = hashlib.sha256(f"tokens\x1f{scope}\x1f{kind}\x1f".encode())
    digest.update(packed)
    return digest.hexdigest()


def image_identity(pixel_values: torch.Tensor, grid: Sequence[int] | torch.Tensor | None) -> str:
    """What names an image's content wherever it is prepared: the patches the model's image
    processor cuts it into (``[patches, dim]``, hashed as float32; before rescaling and
    normalizing where the processor can leave those out) and its patch grid ``(t, h, w)``.

    Why patches and not the file or an engine's hash: a window and an engine decode and
    preprocess the same image with the same processor, so they agree on these values without
    sharing any engine's own hash (vLLM hands its model the patches un-normalized and normalizes
    on the device); an image chunk's key is `token_key` with kind ``"image:<identity>"`` on both
    sides.
    """
    rows = [int(n) for n in torch.as_tensor(grid).flatten().tolist()] if grid is not None else []
    pixels = pixel_values.detach().to("cpu", torch.float32).contiguous()
    return content_key("image", pixels, str(rows))


def _swapped(tokens: Sequence[int]) -> bytes:
    ids = array("q", tokens)
    ids.byteswap()
    return ids.tobytes()
