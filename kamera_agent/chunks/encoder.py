"""Preparing chunks for one model: tokens, preprocessed pixels, positions and content keys.

Why one object per model: everything in a chunk depends on the model's tokenizer, image
processor, chat template and position rules, and its content key must include the model's
fingerprint and the processing settings, so a chunk prepared for one model is never reused
by another. The encoder works from a tokenizer and an image processor directly (a full
Processor is optional: without torchvision, transformers cannot build the Qwen-VL ones).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from PIL import Image

from kamera_agent.chunks.chunk import Chunk, ChunkKind, content_key, image_identity, token_key
from kamera_agent.chunks.positions import PositionScheme
from kamera_agent.chunks.prompt import PromptFormat
from kamera_agent.chunks.sources import MAX_IMAGE_PIXELS, ChannelOrder, ImageLike, to_rgb_image
from kamera_agent.errors import InputError, ProcessorRejectedError, UnsupportedModelError

__all__ = ["ChunkEncoder"]

_IMAGE_KINDS: tuple[ChunkKind, ...] = ("image", "frame", "screenshot", "page")


class ChunkEncoder:
    """Turns images and text into model-ready `Chunk` objects for one model.

    Args:
        tokenizer: the model's tokenizer.
        image_processor: the model's image processor, or ``None`` for a text-only model.
        prompt: where chunks sit in the chat template.
        positions: the model's position scheme.
        model_fingerprint: fingerprint of the model (see `kamera_agent.model_fingerprint`).
        merge_size: vision tokens per side of a merged patch (Qwen-VL: 2).
        tokens_per_image: image tokens of a fixed-size vision tower (LLaVA-style), where the
            processor returns no patch grid.
    """

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any | None,
        prompt: PromptFormat,
        positions: PositionScheme,
        model_fingerprint: str,
        merge_size: int = 1,
        tokens_per_image: int | None = None,
        namespace: str = "",
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.prompt = prompt
        self.positions = positions
        self.model_fingerprint = model_fingerprint
        self.merge_size = merge_size
        self.tokens_per_image = tokens_per_image
        self.settings = _processing_signature(tokenizer, image_processor, prompt)
        self.namespace = namespace
        """Whose chunks these are (an engine request's ``cache_salt`` namespace: `in_namespace`);
        ``""``: nobody's in particular."""
        origin = ("origin", model_fingerprint, self.settings) + ((namespace,) if namespace else ())
        self.origin = content_key(*origin)
        self.anchor_key = token_key(namespace, "text", self.tokens(prompt.anchor))
        """The anchor's key: every text chunk's key is scoped by it (`token_key`), as its canonical
        is computed behind the anchor; the anchor's own by the namespace."""

    def with_prompt(self, prompt: PromptFormat) -> ChunkEncoder:
        """An encoder for the same model and processing with another prompt: another anchor (a
        conversation's system prompt), so another origin and other content keys."""
        return ChunkEncoder(
            self.tokenizer,
            self.image_processor,
            prompt,
            self.positions,
            self.model_fingerprint,
            self.merge_size,
            self.tokens_per_image,
            self.namespace,
        )

    def in_namespace(self, namespace: str) -> ChunkEncoder:
        """An encoder for the same model, processing and prompt whose chunks are keyed in
        ``namespace`` (text through the anchor's key, images and their vision outputs by the
        namespace itself): an engine request with a ``cache_salt`` keys its
        chunks in ``"|<salt>"`` (`kamera_agent.engines.chunking`), so a window in that namespace
        shares their entries, and the drift audits it files vouch for the engine's kept states."""
        return ChunkEncoder(
            self.tokenizer,
            self.image_processor,
            self.prompt,
            self.positions,
            self.model_fingerprint,
            self.merge_size,
            self.tokens_per_image,
            namespace,
        )

    def tokens(self, text: str) -> torch.Tensor:
        """Token ids ``[n]`` of ``text`` without added special tokens.

        Raises:
            InputError: text that is not valid Unicode (a lone surrogate) or not a string.
        """
        if not isinstance(text, str):
            raise InputError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InputError(
                f"the text is not valid Unicode ({exc.reason} at {exc.start}); clean it first"
            ) from exc
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    def anchor(self) -> Chunk:
        """The shared prefix every window starts with (system prompt, user-turn start)."""
        return self._text_chunk(self.prompt.anchor, kind="anchor", label="anchor", scope=self.namespace)

    def text(self, text: str, *, label: str | None = None) -> Chunk:
        """A span of text as a chunk."""
        return self._text_chunk(text, kind="text", label=label)

    def query_ids(self, question: str, answer_start: str = "") -> torch.Tensor:
        """Token ids of a query: the question, the end of the user turn, the assistant's start and
        ``answer_start``, the opening of the answer the model continues (tokenized as one text, as
        a chat template renders a final assistant message it continues)."""
        return self.tokens(self.prompt.query_prefix + question + self.prompt.query_suffix + answer_start)

    def image(
        self,
        item: ImageLike,
        *,
        kind: ChunkKind = "image",
        caption: str | None = None,
        channel_order: ChannelOrder | None = None,
        label: str | None = None,
        meta: dict[str, str] | None = None,
        trailer: str = "",
        max_pixels: int = MAX_IMAGE_PIXELS,
    ) -> Chunk:
        """An image (frame, screenshot, page) framed as the chat template frames images.

        Args:
            item: a PIL image, an array (with ``channel_order``) or an image path.
            kind: what the image is to the agent.
            caption: text placed before the image, e.g. a frame's timestamp (or a message's
                opening role marker).
            trailer: text placed after it (a message's closing marker).
            max_pixels: larger images are refused before decoding (`to_rgb_image`).
            channel_order: ``"rgb"`` or ``"bgr"`` for arrays (never guessed).
            label: the caller's name for it.
            meta: source details kept on the chunk.

        Raises:
            UnsupportedModelError: the model has no image processor or image token.
            ProcessorRejectedError: the image processor refused the image.
        """
        self._check_images(kind)
        image = to_rgb_image(item, channel_order, max_pixels)
        pixel_values, grid = self._preprocess(image)
        n_image = self._image_tokens(grid)
        before = self.tokens((caption or "") + self.prompt.image_open)
        pad = torch.full((n_image,), self._image_token_id(), dtype=torch.long)
        after = self.tokens(self.prompt.image_close + trailer)
        input_ids = torch.cat([before, pad, after])
        mm_types = torch.cat([torch.zeros_like(before), torch.ones_like(pad), torch.zeros_like(after)])
        relative, advance = self.positions.relative(input_ids, mm_types, grid)
        scope = (self.namespace,) if self.namespace else ()  # a salted window's images: its own
        vision_key = content_key("vision", self.model_fingerprint, self.settings, pixel_values, grid, *scope)
        # keyed as an engine keys the same image's span (`kamera_agent.engines.chunking`), so a
        # window and a serving engine on one store share its KV
        key = token_key(self.anchor_key, f"image:{self._identity(image, pixel_values, grid)}", input_ids)
        return Chunk(
            kind,
            key,
            input_ids,
            relative,
            advance,
            mm_types,
            pixel_values,
            grid,
            vision_key,
            label,
            dict(meta or {}),
            self.origin,
        )

    def _check_images(self, kind: ChunkKind) -> None:
        """An image of ``kind`` can be admitted: an image kind, on a model that reads images."""
        if kind not in _IMAGE_KINDS:
            raise InputError(f"kind must be one of {_IMAGE_KINDS} for images, got {kind!r}")
        if self.image_processor is None or self.prompt.image_token is None:
            raise UnsupportedModelError(
                "this model has no image processor or image placeholder token; pass image_processor= "
                "(and a vision-language model) to admit images"
            )

    def _text_chunk(self, text: str, kind: ChunkKind, label: str | None, scope: str | None = None) -> Chunk:
        input_ids = self.tokens(text)
        if input_ids.numel() == 0:
            what = "text" if kind == "text" else f"{kind} text"
            raise InputError(f"the {what} tokenizes to no tokens; pass non-empty text")
        mm_types = torch.zeros_like(input_ids)
        relative, advance = self.positions.relative(input_ids, mm_types, None)
        key = token_key(self.anchor_key if scope is None else scope, "text", input_ids)
        return Chunk(kind, key, input_ids, relative, advance, mm_types, label=label, origin=self.origin)

    def _preprocess(self, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.image_processor is not None
        try:
            out = self.image_processor(images=[image], return_tensors="pt")
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ProcessorRejectedError(
                f"the image processor rejected a {image.size[0]}x{image.size[1]} image: {exc}; resize or "
                "convert the image (e.g. to at least the processor's minimum size)"
            ) from exc
        grid = out.get("image_grid_thw")  # [1, 3] for Qwen-VL; absent for fixed-size towers
        pixels = out["pixel_values"].to(torch.float32)
        return pixels, None if grid is None else grid[:1].to(torch.long)

    def _identity(self, image: Image.Image, pixels: torch.Tensor, grid: torch.Tensor | None) -> str:
        """The image's content identity (`image_identity`) from the processor's output before it
        rescales and normalizes: what an engine that normalizes on its device (vLLM) is handed,
        so both name the image alike. A processor without those switches: its output as is."""
        assert self.image_processor is not None
        try:
            raw = self.image_processor(
                images=[image], return_tensors="pt", do_rescale=False, do_normalize=False
            )
            return image_identity(raw["pixel_values"], grid)
        except (ValueError, TypeError, RuntimeError, KeyError):
            return image_identity(pixels, grid)

    def _image_tokens(self, grid: torch.Tensor | None) -> int:
        if grid is not None:
            return int(grid.prod()) // self.merge_size**2
        if self.tokens_per_image is None:
            raise UnsupportedModelError(
                "the image processor returned no patch grid and the vision tower's token count is unknown"
            )
        return self.tokens_per_image

    def _image_token_id(self) -> int:
        token = self.prompt.image_token
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == getattr(self.tokenizer, "unk_token_id", None):
            raise UnsupportedModelError(f"the tokenizer has no id for the image token {token!r}")
        return token_id


def _processing_signature(tokenizer: Any, image_processor: Any | None, prompt: PromptFormat) -> str:
    """Hash of every processing setting that changes what the model sees."""
    settings: dict[str, Any] = {
        "tokenizer": type(tokenizer).__name__,
        "vocab": len(tokenizer),
        "prompt": prompt.__dict__,
    }
    if image_processor is not None:
        config = image_processor.to_dict() if hasattr(image_processor, "to_dict") else {}
        config.pop("processor_class", None)
        settings["image_processor"] = {"class": type(image_processor).__name__, **config}
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()
