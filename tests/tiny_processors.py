"""Tokenizer and image processors for the tiny models, and offline checkpoints of both.

Why: the tiny models of `tests.tiny_models` take token ids and patch rows; tests that go through
text and images (chat prompts, image resizing, ``from_pretrained``) need the matching
preprocessing, built without any download. The tokenizer is the project's byte-level one; the
image processor is the real Qwen2-VL one configured for the tiny vision towers.

Without torchvision, transformers cannot build ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` /
``Qwen3VLProcessor`` (their video processor needs it: ``AutoProcessor.from_pretrained`` raises
``ImportError``), so `vl_inputs` does the processor's job: render the chat template, expand each
``<|image_pad|>`` to the image's token count, and add ``mm_token_type_ids``. The image processor
is ``Qwen2VLImageProcessorPil``, the class ``AutoImageProcessor`` falls back to without torchvision,
imported directly (importing ``Qwen2VLImageProcessor`` logs a fallback warning).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil

from kamera_agent.models.tiny_tokenizer import DEFAULT_SPECIAL_TOKENS, build_byte_tokenizer
from tests.tiny_models import (
    IMAGE_TOKEN_ID,
    MAX_POSITIONS,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    VOCAB_SIZE,
    Model,
    tiny_llama,
    tiny_qwen2,
    tiny_qwen2_5_vl,
    tiny_qwen2_vl,
    tiny_qwen3_vl,
)

IMAGE_PAD = "<|image_pad|>"
SPECIAL_TOKENS: dict[str, int] = {
    **DEFAULT_SPECIAL_TOKENS,
    IMAGE_PAD: IMAGE_TOKEN_ID,
    "<|video_pad|>": VIDEO_TOKEN_ID,
    "<|vision_start|>": VISION_START_TOKEN_ID,
    "<|vision_end|>": VISION_END_TOKEN_ID,
}

# The tiny vision towers: 14-pixel patches, 2 frames per temporal patch, 2x2 patches per token.
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
# Pixel budget after resizing (``smart_resize`` rounds sides to 28-pixel multiples): between one
# and sixteen image tokens, so a 56x56 image is kept as is (4x4 patches, 4 tokens) and a
# 112x84 one too (8x6 patches, 12 tokens).
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2
MAX_PIXELS = 16 * MIN_PIXELS

VL_FACTORIES: dict[str, Callable[..., Model]] = {
    "qwen2_vl": tiny_qwen2_vl,
    "qwen2_5_vl": tiny_qwen2_5_vl,
    "qwen3_vl": tiny_qwen3_vl,
}
TEXT_FACTORIES: dict[str, Callable[..., Model]] = {"qwen2": tiny_qwen2, "llama": tiny_llama}
# Normalisation (mean, std) of each family's released preprocessor_config.json: OpenAI CLIP's
# for Qwen2-VL and Qwen2.5-VL, 0.5 for Qwen3-VL.
_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
_NORMALISATION: dict[str, tuple[Sequence[float], Sequence[float]]] = {
    "qwen2_vl": _CLIP,
    "qwen2_5_vl": _CLIP,
    "qwen3_vl": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with Qwen's specials at the tiny models' ids, vocab 512."""
    return build_byte_tokenizer(SPECIAL_TOKENS, model_max_length=MAX_POSITIONS, vocab_size=VOCAB_SIZE)


def tiny_image_processor(family: str) -> Qwen2VLImageProcessorPil:
    """The image processor of ``family`` ("qwen2_vl", "qwen2_5_vl", "qwen3_vl") for the tiny towers.

    All three families use the Qwen2-VL image processor class; Qwen3-VL's released one has
    16-pixel patches, set back to 14 here to match the tiny vision config.
    """
    if family not in _NORMALISATION:
        raise KeyError(f"unknown family {family!r}; expected one of {sorted(_NORMALISATION)}")
    mean, std = _NORMALISATION[family]
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=MERGE_SIZE,
        image_mean=list(mean),
        image_std=list(std),
    )


def image_token_counts(image_grid_thw: torch.Tensor, merge_size: int = MERGE_SIZE) -> list[int]:
    """Image tokens per image: ``t * h * w / merge_size**2`` for each row of ``image_grid_thw``."""
    return [int(n) for n in image_grid_thw.prod(dim=-1) // merge_size**2]


def vl_inputs(
    tokenizer: PreTrainedTokenizerFast,
    image_processor: Qwen2VLImageProcessorPil,
    messages: Sequence[Mapping[str, Any]],
    images: Sequence[Image.Image],
    add_generation_prompt: bool = True,
) -> dict[str, torch.Tensor]:
    """Forward kwargs for a chat with images, as the Qwen-VL processor would build them.

    Renders the chat template, replaces the i-th ``<|image_pad|>`` by as many pads as image i
    has tokens, tokenizes, and adds ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``
    (1 on image tokens; transformers 5 requires it with ``image_grid_thw``).
    """
    conversation: list[Any] = [dict(message) for message in messages]
    text = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert isinstance(text, str)
    pieces = text.split(IMAGE_PAD)
    if len(pieces) != len(images) + 1:
        raise ValueError(f"the prompt has {len(pieces) - 1} image slots for {len(images)} images")
    vision = image_processor(images=list(images), return_tensors="pt")
    counts = image_token_counts(vision["image_grid_thw"], image_processor.merge_size)
    text = pieces[0] + "".join(IMAGE_PAD * n + piece for n, piece in zip(counts, pieces[1:], strict=True))
    encoded = tokenizer(text, return_tensors="pt")
    input_ids = encoded["input_ids"]
    return {
        "input_ids": input_ids,
        "attention_mask": encoded["attention_mask"],
        "pixel_values": vision["pixel_values"],
        "image_grid_thw": vision["image_grid_thw"],
        "mm_token_type_ids": (input_ids == IMAGE_TOKEN_ID).int(),
    }


def _set_generation_ids(model: Model, tokenizer: PreTrainedTokenizerFast) -> None:
    """Point ``generate`` at the tokenizer's stop and pad ids (as Qwen's instruct checkpoints do)."""
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id


def save_tiny_vl(path: str | os.PathLike[str], family: str, seed: int = 0, layers: int = 2) -> Model:
    """Save the tiny ``family`` model, its tokenizer and image processor to ``path``; return the model.

    ``AutoModelForImageTextToText``, ``AutoTokenizer`` and ``AutoImageProcessor`` then load the
    directory offline. ``AutoProcessor`` does not without torchvision (see the module docstring).
    Returns the saved model; load with ``attn_implementation="eager"`` to reproduce its logits
    bitwise (config.json does not keep it, and the default, sdpa, differs by ~1e-7).
    """
    if family not in VL_FACTORIES:
        raise KeyError(f"unknown family {family!r}; expected one of {sorted(VL_FACTORIES)}")
    target = Path(path)
    model = VL_FACTORIES[family](seed=seed, layers=layers)  # type: ignore[call-arg]
    tokenizer = tiny_tokenizer()
    _set_generation_ids(model, tokenizer)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    tiny_image_processor(family).save_pretrained(target)
    return model


def save_tiny_text(path: str | os.PathLike[str], name: str, seed: int = 0) -> Model:
    """Save the tiny text model ``name`` ("qwen2", "llama") and the tokenizer to ``path``.

    Returns the saved model. Load with ``attn_implementation="eager"`` to reproduce its logits
    bitwise: config.json does not keep it, and the default (sdpa) differs by ~1e-7.
    """
    if name not in TEXT_FACTORIES:
        raise KeyError(f"unknown text model {name!r}; expected one of {sorted(TEXT_FACTORIES)}")
    target = Path(path)
    model = TEXT_FACTORIES[name](seed=seed)
    tokenizer = tiny_tokenizer()
    _set_generation_ids(model, tokenizer)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return model


# LLaVA-1.5's chat template shape: "USER: <image>\n... ASSISTANT:".
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}"
    "{% endif %}{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}"
    "{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def tiny_llava_tokenizer() -> PreTrainedTokenizerFast:
    """Byte tokenizer with LLaVA's ``<image>`` token at the tiny LLaVA's image id."""
    specials = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258, "<image>": 500}
    return build_byte_tokenizer(specials, chat_template=LLAVA_CHAT_TEMPLATE)


def tiny_llava_image_processor() -> Any:
    """CLIP preprocessing at the tiny tower's 28x28 input size."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
