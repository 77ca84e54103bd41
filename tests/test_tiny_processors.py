"""The byte tokenizer, the tiny image processors, and offline save/load of the tiny checkpoints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
)

from kamera_agent.models.tiny_tokenizer import (
    DEFAULT_SPECIAL_TOKENS,
    QWEN2_VL_CHAT_TEMPLATE,
    build_byte_tokenizer,
)
from tests.tiny_models import VOCAB_SIZE
from tests.tiny_processors import (
    SPECIAL_TOKENS,
    TEXT_FACTORIES,
    VL_FACTORIES,
    image_token_counts,
    save_tiny_text,
    save_tiny_vl,
    tiny_image_processor,
    tiny_tokenizer,
    vl_inputs,
)

FAMILIES = sorted(VL_FACTORIES)
TEXTS = [
    "plain ascii, with . spaces , before ! punctuation ?",
    "héllo wörld — 日本語, 한국어, العربية 🎉👩‍💻",
    "  leading and trailing whitespace\n\ttabs\r\n ",
    "\x00\x01\x7f control bytes and \u200b zero width",
]
# (width, height) -> the grid (t, h, w) in patches after smart_resize to 28-pixel multiples.
SIZES = {(56, 56): (1, 4, 4), (112, 84): (1, 6, 8)}
PATCH_DIM = 3 * 2 * 14 * 14


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _messages(system: bool = True) -> list[dict[str, object]]:
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    return [{"role": "system", "content": "Be brief."}, user] if system else [user]


@pytest.mark.parametrize("text", TEXTS)
def test_bytes_are_their_own_ids_and_round_trip(text: str) -> None:
    tok = tiny_tokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_specials_encode_to_their_single_ids() -> None:
    tok = tiny_tokenizer()
    assert len(tok) == VOCAB_SIZE
    for text, token_id in SPECIAL_TOKENS.items():
        assert tok.encode(text) == [token_id]
        assert tok.convert_ids_to_tokens(token_id) == text
    assert tok.encode("a<|im_start|>b") == [97, SPECIAL_TOKENS["<|im_start|>"], 98]
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    # Unused ids decode to reserved specials, which skip_special_tokens drops.
    assert tok.decode([300, 65, 511]) == "<|reserved_300|>A<|reserved_511|>"
    assert tok.decode([300, 65, SPECIAL_TOKENS["<|im_end|>"]], skip_special_tokens=True) == "A"


def test_default_build_is_deterministic_and_validates_ids() -> None:
    first, second = build_byte_tokenizer(), build_byte_tokenizer()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert dict(DEFAULT_SPECIAL_TOKENS) == SPECIAL_TOKENS  # the defaults are the tiny models' ids
    assert first.chat_template == QWEN2_VL_CHAT_TEMPLATE
    with pytest.raises(ValueError, match="are the bytes"):
        build_byte_tokenizer({"<|x|>": 65})
    with pytest.raises(ValueError, match="distinct"):
        build_byte_tokenizer({"<|x|>": 300, "<|y|>": 300})
    with pytest.raises(ValueError, match="vocabulary has 512"):
        build_byte_tokenizer({"<|x|>": 512})


def test_chat_template_renders_qwen2_vl_prompt() -> None:
    tok = tiny_tokenizer()
    text = tok.apply_chat_template(_messages(), tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    default = tok.apply_chat_template(_messages(system=False), tokenize=False, add_generation_prompt=False)
    assert default.startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    )
    assert default.endswith("What is this?<|im_end|>\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_image_processor_grids_fit_the_tiny_tower(family: str) -> None:
    processor = tiny_image_processor(family)
    model = VL_FACTORIES[family]()
    for (width, height), grid in SIZES.items():
        out = processor(images=_image(width, height), return_tensors="pt")
        assert set(out) == {"pixel_values", "image_grid_thw"}
        assert out["image_grid_thw"].tolist() == [list(grid)]
        assert out["pixel_values"].shape == (grid[0] * grid[1] * grid[2], PATCH_DIM)
    assert image_token_counts(torch.tensor([list(g) for g in SIZES.values()])) == [4, 12]

    tok = tiny_tokenizer()
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}
    ]
    inputs = vl_inputs(tok, processor, messages, [_image(56, 56), _image(112, 84)])
    assert int(inputs["mm_token_type_ids"].sum()) == 4 + 12
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], VOCAB_SIZE)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_vl_checkpoint_loads_offline_with_identical_logits(tmp_path: Path, family: str) -> None:
    model = save_tiny_vl(tmp_path, family)
    # config.json does not keep the attention implementation; the default (sdpa) differs by ~1e-7.
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    processor = AutoImageProcessor.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    assert processor.to_dict() == tiny_image_processor(family).to_dict()
    assert tok.backend_tokenizer.to_str() == tiny_tokenizer().backend_tokenizer.to_str()
    assert tok.chat_template == QWEN2_VL_CHAT_TEMPLATE
    assert loaded.generation_config.eos_token_id == [
        SPECIAL_TOKENS["<|im_end|>"],
        SPECIAL_TOKENS["<|endoftext|>"],
    ]

    inputs = vl_inputs(tok, processor, _messages(), [_image(112, 84)])
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)


@pytest.mark.parametrize("name", sorted(TEXT_FACTORIES))
def test_text_checkpoint_loads_offline_with_identical_logits(tmp_path: Path, name: str) -> None:
    model = save_tiny_text(tmp_path, name)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Hello, wörld!"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        assert torch.equal(loaded(**ids).logits, model(**ids).logits)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_auto_processor_needs_torchvision(tmp_path: Path) -> None:
    """Why `vl_inputs` exists: the Qwen-VL processors build a video processor that needs torchvision."""
    save_tiny_vl(tmp_path, "qwen2_vl")
    with pytest.raises(ImportError, match="requires the Torchvision library"):
        AutoProcessor.from_pretrained(tmp_path)
