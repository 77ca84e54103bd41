"""`DecodeConfig`: the one decode-settings object, checked where it is built and never again.

A bad setting is refused by name at construction; what is derived from a built config (a call's
hooks, the seed of each of several choices) is not checked anew; a caller's mapping is copied.
"""

from __future__ import annotations

from typing import Any

import pytest

from kamera_agent.backends.decode_config import DecodeConfig
from kamera_agent.errors import SettingsError


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[DecodeConfig]:
    """Every `DecodeConfig` checked from now on (its ``__post_init__`` runs the checks)."""
    checked: list[DecodeConfig] = []
    check = DecodeConfig.__post_init__

    def counted(config: DecodeConfig) -> None:
        checked.append(config)
        check(config)

    monkeypatch.setattr(DecodeConfig, "__post_init__", counted)
    return checked


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
        ({"temperature": float("inf")}, "temperature must be finite and >= 0"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an int >= 0"),
        ({"seed": -1}, r"seed must be None or an int in \[0, 2\*\*63\)"),
        ({"stop": ["\n"]}, "stop must be a tuple of non-empty strings"),
        ({"logit_bias": {"7": 1}}, "logit_bias must map token ids"),
        ({"presence_penalty": 3}, r"presence_penalty must be a number in \[-2, 2\]"),
        ({"top_logprobs": 21}, r"top_logprobs must be None or an int in \[0, 20\]"),
        ({"constraint": "json"}, "constraint must be None or a callable"),
        ({"on_text": print, "keep_going": 1}, "keep_going must be None or a callable"),
        ({"return_logits": 1}, "return_logits must be True or False"),
    ],
)
def test_a_bad_setting_is_refused_by_name_with_the_values_it_takes(
    settings: dict[str, Any], named: str
) -> None:
    with pytest.raises(SettingsError, match=named):
        DecodeConfig(**settings)


def test_every_bad_setting_is_named_at_once() -> None:
    with pytest.raises(SettingsError, match=r"max_new_tokens.*; temperature.*; top_k"):
        DecodeConfig(max_new_tokens=0, temperature=-1, top_k=-1)


def test_hooks_are_attached_without_checking_the_settings_again(built: list[DecodeConfig]) -> None:
    config = DecodeConfig(max_new_tokens=4, temperature=0.5, seed=1)
    pieces: list[str] = []
    hooked = config.with_hooks(on_text=pieces.append, keep_going=lambda: True, return_logits=True)
    assert len(built) == 1  # the settings were checked once, when built
    assert (hooked.on_text, hooked.return_logits, hooked.temperature) == (pieces.append, True, 0.5)
    assert config.on_text is None and not config.return_logits  # the config itself is unchanged
    assert config.with_hooks() == config


def test_a_hook_is_checked_and_given_once() -> None:
    with pytest.raises(SettingsError, match="on_text must be None or a callable"):
        DecodeConfig().with_hooks(on_text="print")  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="keep_going is set in the DecodeConfig already"):
        DecodeConfig(keep_going=lambda: True).with_hooks(keep_going=lambda: False)


def test_each_choice_moves_the_seed_on_without_a_check(built: list[DecodeConfig]) -> None:
    seeded = DecodeConfig(seed=2**63 - 2, temperature=1.0)
    assert [seeded.for_choice(i).seed for i in range(4)] == [2**63 - 2, 2**63 - 1, 0, 1]
    assert seeded.for_choice(0) is seeded and len(built) == 1
    unseeded = DecodeConfig(temperature=1.0)
    assert unseeded.for_choice(3) is unseeded


def test_a_callers_mapping_is_copied_read_only_and_numbers_are_floats() -> None:
    bias = {7: 5}
    config = DecodeConfig(logit_bias=bias, temperature=1, top_p=1)
    bias[7] = 100
    assert dict(config.logit_bias) == {7: 5.0}
    with pytest.raises(TypeError):
        config.logit_bias[7] = 1.0  # type: ignore[index]
    assert isinstance(config.temperature, float) and isinstance(config.top_p, float)
