"""A byte-level tokenizer and a patch image processor for `TinyRopeLM`, with no transformers.

Why these two: `ChunkEncoder` needs only the few calls below from a tokenizer and an image
processor, so the tiny model can be fed exactly as a Hugging Face model is, with nothing to
download. Ids ``0..255`` are UTF-8 bytes; the chat template's special tokens are strings
matched inside text (``"<|bos|><|user|>"`` tokenizes to ``[256, 257]``). The model's vocabulary
may be larger than the tokenizer's (as padded vocabularies are); ids past it decode to nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["SPECIAL_TOKENS", "TinyByteTokenizer", "TinyImageProcessor"]

SPECIAL_TOKENS: dict[str, int] = {
    "<|bos|>": 256,
    "<|user|>": 257,
    "<|end|>": 258,
    "<|assistant|>": 259,
    "<|image|>": 260,
    "<|img_start|>": 261,
    "<|img_end|>": 262,
    "<|eos|>": 263,
}
_SPECIAL_BY_ID = {i: token for token, i in SPECIAL_TOKENS.items()}
_SPLIT = re.compile("(" + "|".join(re.escape(token) for token in SPECIAL_TOKENS) + ")")


class TinyByteTokenizer:
    """Bytes as ids ``0..255`` plus eight special tokens ``256..263``."""

    unk_token_id: int | None = None  # every string tokenizes: there is no unknown token
    bos_token_id: int = SPECIAL_TOKENS["<|bos|>"]
    eos_token_id: int = SPECIAL_TOKENS["<|eos|>"]

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        """``{"input_ids": [...]}`` of ``text``; ``add_special_tokens`` prepends ``<|bos|>``."""
        ids = [self.bos_token_id] if add_special_tokens else []
        for piece in _SPLIT.split(text):
            if piece in SPECIAL_TOKENS:
                ids.append(SPECIAL_TOKENS[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return {"input_ids": ids}

    def __len__(self) -> int:
        return 256 + len(SPECIAL_TOKENS)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The id of a special token or of a one-byte character; ``None`` (unknown) otherwise."""
        if token in SPECIAL_TOKENS:
            return SPECIAL_TOKENS[token]
        encoded = token.encode("utf-8")
        return encoded[0] if len(encoded) == 1 else None

    def decode(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``: bytes decoded as UTF-8 (invalid runs replaced), specials kept unless skipped."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        parts: list[str] = []
        run = bytearray()
        for value in (int(v) for v in values):
            if 0 <= value < 256:
                run.append(value)
                continue
            if value in _SPECIAL_BY_ID and not skip_special_tokens:
                parts.append(run.decode("utf-8", errors="replace"))
                parts.append(_SPECIAL_BY_ID[value])
                run = bytearray()
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)


class TinyImageProcessor:
    """Resizes an image to ``image_size`` square RGB in ``[0, 1]`` and cuts it into patches.

    Args:
        image_size: side of the resized image, in pixels.
        patch_size: side of a patch; each patch is one image token of ``3 * patch_size**2`` floats.
    """

    def __init__(self, image_size: int = 16, patch_size: int = 4) -> None:
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} must be a multiple of patch_size {patch_size}")
        self.image_size, self.patch_size = image_size, patch_size

    def __call__(
        self, images: Image.Image | Sequence[Image.Image], return_tensors: str = "pt"
    ) -> dict[str, torch.Tensor]:
        """Patches of every image, row-major, channel-major within a patch.

        Returns:
            ``pixel_values`` ``[images * g * g, 3 * patch_size**2]`` float32 and ``image_grid_thw``
            ``[images, 3]`` rows ``(1, g, g)``, with ``g = image_size // patch_size``.
        """
        if return_tensors != "pt":
            raise ValueError(f"only return_tensors='pt' is supported, got {return_tensors!r}")
        batch = [images] if isinstance(images, Image.Image) else list(images)
        if not batch:
            raise ValueError("no images given")
        s, p = self.image_size, self.patch_size
        g = s // p
        pixels, grids = [], []
        for image in batch:
            if not isinstance(image, Image.Image):
                raise TypeError(f"expected a PIL image, got {type(image).__name__}")
            rgb = image.convert("RGB").resize((s, s), Image.Resampling.BICUBIC)
            array = torch.from_numpy(np.asarray(rgb, dtype=np.float32) / np.float32(255.0))  # [s, s, 3]
            patches = array.reshape(g, p, g, p, 3).permute(0, 2, 4, 1, 3).reshape(g * g, 3 * p * p)
            pixels.append(patches)
            grids.append([1, g, g])
        return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(grids, dtype=torch.long)}

    def to_dict(self) -> dict[str, Any]:
        """The settings that change the pixels (part of every image chunk's content key)."""
        return {
            "image_size": self.image_size,
            "patch_size": self.patch_size,
            "resample": "bicubic",
            "scale": 255,
        }
