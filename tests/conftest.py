"""Test-wide settings: one torch thread (small ops on busy 2-core machines), fixed seeds."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from kamera_agent.settings import configure_threads
from tests.side_envs import IN_SIDE_RUN, ROOT, SIDE_FOLDERS, SIDE_RUNS, start, stop

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
configure_threads(1)

# SGLang's own classes live in .venv-sglang (scripts/sglang_env.sh): its tests are collected
# there, and run from this environment by tests/engines/test_sglang_env.py.
collect_ignore = [] if importlib.util.find_spec("sglang") else ["engines/sglang"]
# vLLM's CPU build lives in .venv-vllm (scripts/vllm_env.sh), run by tests/engines/test_vllm_env.py.
if not importlib.util.find_spec("vllm"):
    collect_ignore.append("engines/vllm")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A side folder .venv could collect is left to its side run (tests/side_envs.py), unless
    this is that run or the command line names the folder or a file in it."""
    if os.environ.get(IN_SIDE_RUN) or not collection_path.is_relative_to(ROOT):
        return None
    relative = collection_path.relative_to(ROOT).as_posix()
    if relative not in SIDE_FOLDERS:
        return None
    named = (Path(arg.split("::")[0]).resolve() for arg in config.args)
    return not any(path == collection_path or path.is_relative_to(collection_path) for path in named)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that read a side run (tests/side_envs.py) go last, so the rest run while it does."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] in SIDE_RUNS)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Begin the side runs the chosen tests read (none when only collecting)."""
    if session.config.option.collectonly:
        return
    chosen = {item.nodeid.split("::")[0] for item in session.items}
    for test_file in sorted(chosen & SIDE_RUNS.keys()):
        start(test_file)


def pytest_unconfigure() -> None:
    """Stop side runs no test read (a run cut short by -x, -k or a failure)."""
    stop()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def untrained_demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kamera-tiny-vl's architecture, tokenizer and image processor with random weights, saved
    as a checkpoint directory: the demo, examples and bench run on it without trained weights."""
    from transformers import Qwen2VLForConditionalGeneration

    from kamera_agent.demo.model import demo_config, demo_image_processor, demo_tokenizer

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("kamera-tiny-vl-untrained")
    Qwen2VLForConditionalGeneration(demo_config()).save_pretrained(path)
    demo_tokenizer().save_pretrained(path)
    demo_image_processor().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_text_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama (SmolLM2's architecture) with the byte tokenizer, saved as a
    checkpoint folder: what ``--model`` names when a suite runs on a text model."""
    from tests.backends.test_transformers_backend import sharpen
    from tests.tiny_models import tiny_llama
    from tests.tiny_processors import tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama-text")
    sharpen(tiny_llama(num_hidden_layers=4)).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
