"""Making a window: from a checkpoint path, a loaded model, a backend; config presets."""

from __future__ import annotations

from pathlib import Path

import pytest

from kamera_agent import KameraWindow, UnsupportedModelError, WindowConfig
from kamera_agent.backends.base import DecodeConfig
from kamera_agent.loading import load_model
from tests.backends.test_transformers_backend import images
from tests.tiny_models import tiny_qwen2
from tests.tiny_processors import save_tiny_vl
from tests.window.helpers import answer_kl, chunk_errors


def test_a_window_from_a_checkpoint_path_alone(tmp_path: Path) -> None:
    save_tiny_vl(tmp_path, "qwen2_5_vl", layers=4)
    window = KameraWindow(
        tmp_path, config=WindowConfig(rank="full", disk_dir=tmp_path / "store", disk_limit=1 << 26)
    )
    window.push(images(1, seed=31)[0], label="frame")
    window.push("and a caption")
    assert max(chunk_errors(window).values()) < 2e-5
    assert answer_kl(window) < 1e-9
    assert window.store.disk_dir == tmp_path / "store"


def test_a_window_from_a_loaded_model_finds_its_processing(tmp_path: Path) -> None:
    save_tiny_vl(tmp_path, "qwen2_vl", layers=4)
    window = KameraWindow(load_model(tmp_path))
    window.push(images(1, seed=32)[0])
    assert window.ask("What?", decode=DecodeConfig(max_new_tokens=2)).tokens


def test_a_window_without_processing_pieces_says_what_to_pass() -> None:
    with pytest.raises(UnsupportedModelError, match="tokenizer="):
        KameraWindow(tiny_qwen2())


def test_removal_patches_make_survivors_exact_again(tmp_path: Path) -> None:
    save_tiny_vl(tmp_path, "qwen3_vl", layers=4)
    window = KameraWindow(tmp_path, config=WindowConfig(rank="full", survivors="removal"))
    for seed in (33, 34, 35):
        window.push(images(1, seed=seed)[0])
    window.slide()
    # The new first chunk is served as its canonical (formed now: pushes keep only the exact KV
    # their one forward gives) and the last one gets one removal patch (it encoded the first):
    # one forward from the first slot computes both.
    assert window.stats.last.forwards == 1 and window.stats.last.canonicals_formed == 1
    assert max(chunk_errors(window).values()) < 2e-5


def test_presets_pick_exact_patches_for_tiny_models() -> None:
    assert WindowConfig.for_model(tiny_qwen2()).rank == "full"
    assert WindowConfig.for_model(tiny_qwen2(), rank=8).rank == 8
    with pytest.raises(ValueError, match="disk_dir and disk_limit"):
        WindowConfig(disk_limit=10)


@pytest.mark.parametrize("salt", ["", 5, b"agent"])
def test_a_cache_salt_is_a_namespace_or_none(salt: object) -> None:
    from kamera_agent.errors import ArgumentError
    from tests.window.backends import backend_named

    with pytest.raises(ArgumentError, match="cache_salt"):
        KameraWindow(backend_named("qwen2"), config=WindowConfig.exact(), cache_salt=salt)  # type: ignore[arg-type]
