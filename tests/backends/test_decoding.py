"""The shared decode loop's token scores: logit bias, presence and frequency penalties, logprobs.

Why: ``kamera serve`` passes OpenAI's ``logit_bias``, ``presence_penalty``,
``frequency_penalty``, ``logprobs`` and ``top_logprobs`` through to here; each must do what
OpenAI documents, checked against the model's own logits (a 4-layer Qwen2 through a window).
"""

from __future__ import annotations

import math

import pytest
import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.backends.decoding import _Scores
from kamera_agent.config import WindowConfig
from kamera_agent.errors import ArgumentError, SettingsError
from kamera_agent.window import KameraWindow
from tests.window.backends import backend_named


def _window() -> KameraWindow:
    window = KameraWindow(backend_named("qwen2"), config=WindowConfig.exact())  # type: ignore[arg-type]
    window.extend(["the red ball rolled left", "then the blue cube fell"])
    return window


def test_logprobs_are_the_log_softmax_of_the_models_scores_with_the_top_alternatives() -> None:
    window = _window()
    answer = window.ask(
        "what moved?", decode=DecodeConfig(max_new_tokens=4, top_logprobs=3), return_logits=True
    )
    assert answer.logprobs is not None and len(answer.logprobs) == len(answer.tokens)
    assert answer.logits is not None
    for step, entry in enumerate(answer.logprobs):
        expected = torch.log_softmax(answer.logits[step].double(), -1)
        assert entry.token == answer.tokens[step]
        assert math.isclose(entry.logprob, float(expected[entry.token]), abs_tol=1e-4)
        assert [token for token, _ in entry.top] == expected.topk(3).indices.tolist()
        assert entry.top[0][0] == entry.token  # greedy: the chosen token is the most likely
    assert window.ask("what moved?", decode=DecodeConfig(max_new_tokens=2)).logprobs is None


def test_a_logit_bias_bans_or_forces_a_token() -> None:
    window = _window()
    greedy = window.ask("what moved?", decode=DecodeConfig(max_new_tokens=1))
    first = greedy.tokens[0]
    banned = window.ask("what moved?", decode=DecodeConfig(max_new_tokens=1, logit_bias={first: -100}))
    assert banned.tokens[0] != first
    assert banned.tokens[0] == int(greedy.first_logits.topk(2).indices[1])  # the runner-up
    forced = window.ask("what moved?", decode=DecodeConfig(max_new_tokens=3, logit_bias={7: 100}))
    assert forced.tokens[:1] == [7]


def test_penalties_follow_openais_definition() -> None:
    config = DecodeConfig(presence_penalty=0.5, frequency_penalty=0.25)
    logits = torch.zeros(10)
    scores = _Scores(config, logits).adjust(logits, [5, 5, 7])
    expected = torch.zeros(10)
    expected[5], expected[7] = -(0.5 + 2 * 0.25), -(0.5 + 0.25)
    assert torch.equal(scores, expected)
    assert _Scores(DecodeConfig(), logits).adjust(logits, [5]) is logits  # nothing to adjust: no copy


def test_a_frequency_penalty_stops_a_greedy_answer_from_repeating_itself() -> None:
    window = _window()
    plain = window.ask("what moved?", decode=DecodeConfig(max_new_tokens=24)).tokens
    penalised = window.ask(
        "what moved?", decode=DecodeConfig(max_new_tokens=24, frequency_penalty=2.0, presence_penalty=2.0)
    ).tokens
    assert len(set(penalised)) >= len(set(plain))
    assert max(penalised.count(t) for t in set(penalised)) <= max(plain.count(t) for t in set(plain))


@pytest.mark.parametrize(
    "settings",
    [{"logit_bias": {-1: 1.0}}, {"logit_bias": {3: 101}}, {"presence_penalty": 3}, {"top_logprobs": 21}],
)
def test_out_of_range_decode_settings_are_refused(settings: dict[str, object]) -> None:
    with pytest.raises(SettingsError):
        DecodeConfig(**settings)  # type: ignore[arg-type]
    with pytest.warns(DeprecationWarning), pytest.raises(ArgumentError):  # the keywords' deprecated form
        _window().ask("q", **settings)
