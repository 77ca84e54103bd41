"""What a model path names: GGUF files converted once, folders as they are, and every path kamera
cannot load refused by a named error that says what to pass instead."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kamera_agent import checkpoints
from kamera_agent.checkpoints import CACHE_DIR_VARIABLE, load_model, resolve_checkpoint
from kamera_agent.errors import CheckpointError, TokenizerNotFoundError, UnsupportedModelError
from kamera_agent.fingerprint import checkpoint_fingerprint, model_fingerprint
from kamera_agent.loading import load_backend
from tests.gguf_files import write_llama_gguf
from tests.real_env import ensure_real_models
from tests.tiny_models import tiny_llama
from tests.tiny_processors import tiny_tokenizer


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of the test's own: conversions and fingerprints start from nothing; the GGUF
    reader installed (with the real models) where it is missing."""
    ensure_real_models()
    monkeypatch.setenv(CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def gguf_file(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model = tiny_llama(num_hidden_layers=4)
    (tmp_path / "gguf").mkdir()
    return write_llama_gguf(model, tmp_path / "gguf" / "tiny.gguf"), model


def test_a_gguf_file_is_converted_once_into_the_same_weights(
    gguf_file: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, original = gguf_file
    checkpoint = resolve_checkpoint(path)
    assert checkpoint.gguf == path and (checkpoint.folder / "config.json").is_file()
    loaded = load_model(path)
    ids = torch.randint(0, 500, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (loaded(ids).logits - original(ids).logits).abs().max()
    assert gap < 1e-5  # llama.cpp's q/k layout undone: the model computes what the original does

    def never(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(checkpoints, "_convert", never)
    assert resolve_checkpoint(path).folder == checkpoint.folder  # found by content, not converted again
    assert resolve_checkpoint(path.parent).folder == checkpoint.folder  # the folder holding one GGUF file


def test_one_fingerprint_by_gguf_file_folder_and_loaded_model(
    gguf_file: tuple[Path, torch.nn.Module],
) -> None:
    path, _ = gguf_file
    folder = resolve_checkpoint(path).folder
    by_object = model_fingerprint(load_model(folder))
    assert checkpoint_fingerprint(path) == checkpoint_fingerprint(folder) == by_object
    assert checkpoint_fingerprint(path, torch.bfloat16) != by_object  # the dtype served is part of it


def test_a_gguf_file_without_tokenizer_metadata_asks_for_a_tokenizer(
    gguf_file: tuple[Path, torch.nn.Module],
) -> None:
    path, _ = gguf_file
    with pytest.raises(TokenizerNotFoundError, match=r"tokenizer=.*carries none"):
        load_backend(path)
    backend = load_backend(path, tokenizer=tiny_tokenizer())  # what the message asks for works
    assert backend.layout.num_layers == 4


def test_a_model_read_from_a_gguf_file_finds_its_origin(gguf_file: tuple[Path, torch.nn.Module]) -> None:
    from transformers import AutoModelForCausalLM

    path, _ = gguf_file
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    with pytest.raises(TokenizerNotFoundError, match="carries none"):  # looked for at its GGUF file
        load_backend(loaded)
    assert load_backend(loaded, tokenizer=tiny_tokenizer()).fingerprint == checkpoint_fingerprint(path)


def test_paths_that_are_no_model_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        resolve_checkpoint(tmp_path / "missing")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        resolve_checkpoint(text)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json and no GGUF file"):
        resolve_checkpoint(tmp_path / "empty")
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text(json.dumps(tiny_llama().config.to_dict()))
    with pytest.raises(CheckpointError, match="no weights"):
        load_backend(weightless)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="several GGUF files"):
        resolve_checkpoint(two)


def test_an_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=512)).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        load_backend(tmp_path)


def test_reading_gguf_without_its_packages_names_the_extra(
    gguf_file: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = gguf_file
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(CheckpointError, match=r"kamera-agent\[gguf\]"):
        resolve_checkpoint(path)
