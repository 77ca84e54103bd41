"""How an answer is decoded: one settings object, validated once where it is built.

Why one object (the shape of nano-vllm's ``SamplingParams``): the settings travel from whoever
asks (a user's ``window.ask``, a server's request) through the window and the core to the
engine's decode loop. Checked at construction, they are passed down as they are; nothing below
checks them again. A server builds one per request and derives each choice's from it
(`DecodeConfig.for_choice`); a caller's streaming and cancelling hooks are attached to a copy
(`DecodeConfig.with_hooks`) without checking the settings anew.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

import torch

from kamera_agent.errors import SettingsError

__all__ = ["HOOKS", "SEED_LIMIT", "Constraint", "DecodeConfig"]

SEED_LIMIT = 1 << 63
"""Seeds are ints in ``[0, 2**63)`` (a signed 64-bit integer's non-negative range, as OpenAI's)."""

HOOKS = ("on_text", "keep_going", "return_logits")
"""The fields that belong to one call rather than to the settings (what a caller watches)."""


class Constraint(Protocol):
    """A grammar over an answer's tokens, followed token by token (structured output)."""

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` ``[vocab]`` with every token the grammar does not allow next at ``-inf``."""
        ...

    def accept(self, token: int) -> None:
        """The token chosen (one the mask allowed)."""
        ...

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing more may follow."""
        ...


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """How to generate an answer (every field by keyword: eight positional values are a bug
    waiting for one reordering).

    Example:
        ``window.ask("What changed?", decode=DecodeConfig(max_new_tokens=64, temperature=0.7, seed=1))``

    Attributes:
        max_new_tokens: tokens to generate at most.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_k: sample among the k most likely tokens (0: all).
        top_p: nucleus sampling mass (1.0: all).
        seed: sampling seed, for reproducible samples.
        stop: strings that end the answer (not included in it).
        return_logits: keep the logits of every generated step.
        on_text: called with each new piece of the answer's text as it is decoded; text that
            may be the start of a stop string is held back until it cannot be.
        keep_going: asked before each generated token; ``False`` ends the answer there with
            ``finish_reason="cancelled"`` (a server's client went away).
        logit_bias: token id -> a value added to its logit at every step (OpenAI's: -100
            bans a token, 100 all but forces it); kept as a read-only copy.
        presence_penalty: subtracted from the logit of every token already in the answer.
        frequency_penalty: subtracted once per time a token is already in the answer.
        top_logprobs: ``None``: no log-probabilities; ``k >= 0``: each answer token's
            log-probability and its step's ``k`` most likely tokens (`Answer.logprobs`).
        constraint: makes a fresh `Constraint` for each decode (structured output: only
            tokens its grammar allows are chosen, and the answer ends when it is complete).

    Raises:
        SettingsError: every field that is out of range or of the wrong type, by name, with
            the values it takes.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    return_logits: bool = False
    on_text: Callable[[str], None] | None = None
    keep_going: Callable[[], bool] | None = None
    logit_bias: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int | None = None
    constraint: Callable[[], Constraint] | None = None

    def __post_init__(self) -> None:
        """Refuse what the decode loop cannot run (a setting that would decode nonsense or nothing)."""
        problems = _setting_problems(self) + _hook_problems(self.on_text, self.keep_going, self.return_logits)
        if problems:
            raise SettingsError("; ".join(problems))
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):  # torch cannot
            object.__setattr__(self, name, float(getattr(self, name)))  # divide by an int past 64 bits
        bias = {int(token): float(value) for token, value in self.logit_bias.items()}
        object.__setattr__(self, "logit_bias", MappingProxyType(bias))  # a caller's dict may change

    def with_hooks(
        self,
        *,
        on_text: Callable[[str], None] | None = None,
        keep_going: Callable[[], bool] | None = None,
        return_logits: bool = False,
    ) -> DecodeConfig:
        """These settings with one call's hooks attached (only the hooks are checked: the
        settings were when this config was built).

        Raises:
            SettingsError: a hook that is not callable, or one this config already holds.
        """
        problems = _hook_problems(on_text, keep_going, return_logits)
        problems += [
            f"{name} is set in the DecodeConfig already: pass it once"
            for name, hook in (("on_text", on_text), ("keep_going", keep_going))
            if hook is not None and getattr(self, name) is not None
        ]
        if problems:
            raise SettingsError("; ".join(problems))
        return self._copy(
            on_text=self.on_text if on_text is None else on_text,
            keep_going=self.keep_going if keep_going is None else keep_going,
            return_logits=return_logits or self.return_logits,
        )

    def for_choice(self, index: int) -> DecodeConfig:
        """The settings of answer ``index`` of several to one prompt (OpenAI's ``n``): its seed
        moved on by ``index`` (mod ``2**63``), so seeded answers differ and each reproduces;
        unseeded settings are these."""
        if self.seed is None or index == 0:
            return self
        return self._copy(seed=(self.seed + index) % SEED_LIMIT)

    def _copy(self, **changes: object) -> DecodeConfig:
        """A copy with ``changes`` that are valid by construction (not checked again)."""
        changed = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(changed, name, value)
        return changed


def _setting_problems(config: DecodeConfig) -> list[str]:
    """What is wrong with the settings, each naming its field and the values it takes."""
    problems = []
    if not _is_int(config.max_new_tokens) or config.max_new_tokens < 1:
        problems.append(f"max_new_tokens must be an int >= 1, got {config.max_new_tokens!r}")
    if not _is_real(config.temperature) or config.temperature < 0:
        problems.append(f"temperature must be finite and >= 0 (0: greedy), got {config.temperature!r}")
    if not (_is_real(config.top_p) and 0 < config.top_p <= 1):
        problems.append(f"top_p must be in (0, 1], got {config.top_p!r}")
    if not _is_int(config.top_k) or config.top_k < 0:
        problems.append(f"top_k must be an int >= 0 (0: all), got {config.top_k!r}")
    if config.seed is not None and (not _is_int(config.seed) or not 0 <= config.seed < SEED_LIMIT):
        problems.append(f"seed must be None or an int in [0, 2**63), got {config.seed!r}")
    stops = config.stop if isinstance(config.stop, tuple) else (None,)
    if any(not isinstance(stop, str) or not stop for stop in stops):
        problems.append("stop must be a tuple of non-empty strings")
    if not isinstance(config.logit_bias, Mapping) or any(
        not _is_int(token) or token < 0 or not _is_real(bias) or abs(bias) > 100
        for token, bias in config.logit_bias.items()
    ):
        problems.append("logit_bias must map token ids (ints >= 0) to numbers in [-100, 100]")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(config, name)
        if not _is_real(value) or abs(value) > 2:
            problems.append(f"{name} must be a number in [-2, 2], got {value!r}")
    if config.top_logprobs is not None and (
        not _is_int(config.top_logprobs) or not 0 <= config.top_logprobs <= 20
    ):
        problems.append(f"top_logprobs must be None or an int in [0, 20], got {config.top_logprobs!r}")
    if config.constraint is not None and not callable(config.constraint):
        kind = type(config.constraint).__name__
        problems.append(f"constraint must be None or a callable that makes a Constraint, got a {kind}")
    return problems


def _hook_problems(on_text: object, keep_going: object, return_logits: object) -> list[str]:
    problems = [
        f"{name} must be None or a callable, got {value!r}"
        for name, value in (("on_text", on_text), ("keep_going", keep_going))
        if value is not None and not callable(value)
    ]
    if not isinstance(return_logits, bool):
        problems.append(f"return_logits must be True or False, got {return_logits!r}")
    return problems


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
