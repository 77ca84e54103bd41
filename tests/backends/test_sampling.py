"""Sampling that samples: unseeded draws from fresh entropy, seeded ones reproducible, and the
same draws whichever engine produced the logits.

Why: an answer's generator was seeded only when a seed was given, so every unseeded answer
started from the generator's fixed default seed and six requests at temperature 1 gave one answer
six times. Both backends hand their logits to one loop (`decode_loop`); fed the same logits and
seed, their tokens must agree.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.backends.decoding import pick_token, sampler
from tests.window.backends import backend_named

VOCAB = 64


def _scripted(step: int) -> torch.Tensor:
    """Step ``step``'s logits ``[VOCAB]``: flat enough that sampling has real choices."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 + step)) * 0.5


class _Script:
    """Counts forwards and answers each with the next scripted logits."""

    def __init__(self) -> None:
        self.step = 0

    def logits(self) -> torch.Tensor:
        out = _scripted(self.step)
        self.step += 1
        return out


class _TinyModel:
    """Stands in for the tiny model's module: the backend's decode calls ``embed``, the model and
    ``logits``; the script decides the logits."""

    def __init__(self, script: _Script) -> None:
        self.script = script

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(int(ids.shape[0]), 1)

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, cache: Any) -> tuple[Any, Any]:
        return hidden, cache

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.script.logits()


def _scripted_tokens(name: str, seed: int | None, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Tokens the named backend's own decode draws over the scripted logits."""
    backend: Any = backend_named(name)
    script = _Script()
    if name == "tiny_torch":
        monkeypatch.setattr(backend, "model", _TinyModel(script))
        cache = backend.assemble([])
    else:
        monkeypatch.setattr(backend, "forward_tokens", lambda ids, positions, cache: (cache, script.logits()))
        cache = backend.empty_cache()
    monkeypatch.setattr(backend, "_eos", set(), raising=False)  # the transformers backend's end ids
    config = DecodeConfig(max_new_tokens=24, temperature=1.0, seed=seed)
    decoded = backend.decode(cache, torch.tensor([1, 2, 3]), 0, config)
    monkeypatch.undo()
    return decoded.answer.tokens


def test_the_two_backends_draw_the_same_tokens_from_the_same_logits_and_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tiny = _scripted_tokens("tiny_torch", 7, monkeypatch)
    transformers = _scripted_tokens("qwen2", 7, monkeypatch)
    assert tiny == transformers and len(tiny) == 24
    assert _scripted_tokens("qwen2", 8, monkeypatch) != tiny  # the seed decides the draws


def test_unseeded_draws_differ_and_seeded_ones_repeat() -> None:
    flat = torch.zeros(1000)  # every token equally likely
    config = DecodeConfig(temperature=1.0)
    unseeded = [pick_token(flat, config, sampler(None)) for _ in range(20)]
    assert len(set(unseeded)) > 1, unseeded
    seeded = [
        [pick_token(flat, config, generator) for _ in range(5)] for generator in (sampler(3), sampler(3))
    ]
    assert seeded[0] == seeded[1]
