"""Loading through the normal ``from_pretrained`` path, from a checkpoint the test saves itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from kamera_agent.errors import UnsupportedModelError
from kamera_agent.loading import load_backend, load_model
from tests.backends.test_transformers_backend import check_against_generate, images
from tests.tiny_models import tiny_qwen2
from tests.tiny_processors import save_tiny_text, save_tiny_vl


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_a_saved_vl_checkpoint_loads_and_answers_like_generate(tmp_path: Path, family: str) -> None:
    save_tiny_vl(tmp_path, family)
    backend = load_backend(tmp_path)
    assert backend.supports_vision
    enc = backend.encoder
    chunks = [enc.image(images(1, seed=4)[0]), enc.text("then"), enc.image(images(1, seed=5)[0])]
    # Saved at the usual init (std 0.02) the model barely conditions: the blind gap is small
    # but still well above float noise (~1e-13 at full rank).
    check_against_generate(backend, chunks, "What changed?", min_blind_kl=1e-10)


def test_a_loaded_model_finds_its_processing_pieces_from_its_directory(tmp_path: Path) -> None:
    save_tiny_text(tmp_path, "qwen2")
    model = load_model(tmp_path)
    backend = load_backend(model)
    assert backend.prompt.anchor.startswith("<|im_start|>system")
    chunks = [backend.encoder.text("a b c"), backend.encoder.text("d")]
    check_against_generate(backend, chunks, "next?", min_blind_kl=1e-10)


def test_a_model_without_processing_pieces_gets_a_clear_error() -> None:
    with pytest.raises(UnsupportedModelError, match="tokenizer="):
        load_backend(tiny_qwen2())
