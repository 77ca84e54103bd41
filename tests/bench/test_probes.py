"""The questions the text benchmarks check answers on can tell windows apart, on a real model.

Why: an episode compares the first answer token of each side with a re-prefill's. A question
whose answer opens with the same token whatever was read ("The") agrees on every op however far
a side drifted, and a benchmark built on it cannot fail. Each question is asked here over windows
of different content on SmolLM2, re-prefilled: its first token must differ between some of them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kamera_agent.backends.base import Backend
from kamera_agent.bench.agents.script import Question
from kamera_agent.bench.agents.text_contents import QUICK_TEXT_LENGTHS, TEXT_QUESTIONS, TextContents
from kamera_agent.bench.corpus import QUESTION, passages
from kamera_agent.loading import load_backend
from kamera_agent.models.real import real_model_gguf
from tests.real_env import ensure_real_models

WINDOWS = 4


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    ensure_real_models()
    torch.set_num_threads(1)
    yield load_backend(real_model_gguf("smollm2"))


def _first_tokens(backend: Backend, question: Question, windows: list[list[str]]) -> set[int]:
    ids = question.ids(backend.encoder)
    tokens = set()
    for texts in windows:
        chunks = [backend.encoder.text(text) for text in texts]
        tokens.add(int(backend.reference_prefill(chunks, ids).logits.argmax()))
    return tokens


def test_the_window_suites_question_names_what_was_read(backend: Backend) -> None:
    windows = [passages("benchmark", seed, 2) for seed in range(WINDOWS)]
    assert len(_first_tokens(backend, Question(*QUESTION), windows)) > 1


@pytest.mark.parametrize("question", TEXT_QUESTIONS, ids=lambda q: q.text[:20])
def test_each_text_agents_question_names_what_was_read(backend: Backend, question: Question) -> None:
    contents = TextContents(backend.encoder, QUICK_TEXT_LENGTHS, seed=3)
    windows = [[contents.text("item", i), contents.text("screenshot", i)] for i in range(WINDOWS)]
    assert len(_first_tokens(backend, question, windows)) > 1
