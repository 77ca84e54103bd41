"""Drift judged in answer units: what the window's approximations do to its next answer.

Why: relative KV error does not tell a real model's harmless approximations from harmful ones
(on agents' drops, survivors that change no answer measure KV errors as large as the harmful
ones of the calibration's episodes: `benchmarks/replay_frontier.py`). What a user sees is the
answer. After an op, each chunk it approximated gets its first rows recomputed exactly over
its left (after a change to its left those rows drifted most, `benchmarks/slide_repair.py`),
and they are kept: a repair. A probe is decoded over the window before and after; the move the
repaired rows made, extrapolated to all of the approximated chunks' rows, over-estimates what
the rest still owes (the rows after the first drifted less: `benchmarks/answer_judge.py`). The
approximations stand where that estimate leaves the probe's first token as it is and its KL within
the budget.

The probe is the end of a user turn and the assistant's opening: what every chat request
decodes, so a window judges an op before it knows the question (on SmolLM2 it judged as well as
the question itself; on Gemma 3, which frames no turns here, its newline could not judge:
`benchmarks/answer_judge.py`, docs/concepts.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kamera_agent.divergence import next_token_kl

__all__ = ["ANSWER_SHARE", "AnswerEstimate", "combined", "estimate_answer", "room", "spread"]

ANSWER_SHARE = 0.3
"""The share of each approximated chunk's first rows an answer-unit budget recomputes (they
stay in its KV): the share at which, on SmolLM2's slides, the estimate let most ops stand with
no first token changed (`benchmarks/answer_judge.py`)."""


@dataclass(frozen=True)
class AnswerEstimate:
    """What the approximations left after the repair are estimated to do to the probe's answer."""

    kl: float
    """KL(extrapolated ‖ repaired) of the next token: the estimate of what the rest still owes."""
    same_top: bool
    """Whether the extrapolated answer has the repaired one's first token."""


def estimate_answer(served: torch.Tensor, repaired: torch.Tensor, scale: float) -> AnswerEstimate:
    """The estimate from the probe's next-token logits before (``served``) and after (``repaired``)
    the repair, which recomputed ``1 / scale`` of the approximated rows: the move extrapolated to
    all of them (logits are near-linear in small KV changes)."""
    served, repaired = served.float().flatten(), repaired.float().flatten()
    guess = repaired + (scale - 1.0) * (repaired - served)
    return AnswerEstimate(next_token_kl(guess, repaired), int(guess.argmax()) == int(repaired.argmax()))


def combined(earlier: float, added: float) -> float:
    """A bound on the KL of two drifts together, from each one's: KL is about a squared distance
    (the Fisher metric's, for small changes), so their square roots add (the triangle rule)."""
    return (math.sqrt(max(earlier, 0.0)) + math.sqrt(max(added, 0.0))) ** 2


def room(epsilon: float, earlier: float) -> float:
    """The most an op's own estimate may add to ``earlier`` and stay within ``epsilon`` (the
    inverse of `combined`)."""
    left = math.sqrt(max(epsilon, 0.0)) - math.sqrt(max(earlier, 0.0))
    return left * left if left > 0 else 0.0


def spread(kl: float, tokens: list[int]) -> list[float]:
    """A verdict's estimate over the rows it judged, spread by their tokens: the extrapolation
    holds each row's share of the answer's move alike, so a part with ``t`` of the ``T`` tokens owns
    ``(t / T)² · kl``, and `combined` over all parts gives ``kl`` back. Why not all of it under
    the first: once the parts right of it are re-prefilled, a small chunk left behind would carry
    the whole window's estimate and refuse every later op over it."""
    total = sum(tokens)
    return [kl * (t / total) ** 2 if total else 0.0 for t in tokens]
