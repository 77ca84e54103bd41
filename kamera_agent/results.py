"""Typed results of window operations: what was done, what it cost, what came out.

Why typed: an agent loop branches on these (is this chunk disposable? did that reorder run a
forward?), so each op returns a small frozen object rather than tuples or sentinels.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from dataclasses import dataclass, field, fields
from typing import Literal

import torch

__all__ = ["Answer", "Edit", "EditKind", "OpCost", "Plan", "Probe", "TokenLogprob", "WindowStats"]

EditKind = Literal[
    "form_canonical",
    "rotate",
    "apply_patch",
    "form_patch",
    "revert",
    "defer",
    "admit",
    "recall",
    "evict",
    "probe",
]


@dataclass(frozen=True)
class OpCost:
    """What one operation spent (or, summed, a whole episode).

    Attributes:
        forwards: language-model forwards run (canonical prefills, patch-forming forwards, decodes).
        tokens_prefilled: tokens those forwards processed.
        tokens_reused: chunk tokens served from the store by rotation and patch, with no forward.
        tokens_placed: window tokens placed (rotated, patched) and copied into the engine cache an
            answer decodes over; those its retained cache already held at the same place are not.
        vision_encodes: vision-tower runs.
        canonicals_formed: canonical prefills run (``KV(B|∅)`` behind the anchor); zero when
            the store (a shared one included) already held every canonical the op needed.
        reforms: KV formed again because the store's budget had dropped it (a canonical or a
            full state's KV; ``reencodes`` is its deprecated old name).
        patches_formed: patches computed (each from one conditioned forward + an SVD).
        patches_applied: stored patches reused with no forward.
        bytes_added: bytes of new canonicals, vision outputs and patches written to the store.
        uncached: entries too large for the store's budget, used for this op without being stored.
        forgotten: evicted chunks dropped for good (``max_evicted`` or ``forget``).
        probes: chunks scored by a probe decode (probe-driven eviction).
        audits: chunks the drift budget audited (`kamera_agent.fidelity`).
        audit_tokens: tokens those audits recomputed (in ``tokens_prefilled`` too).
        drift_fixes: chunks re-prefilled to keep the drift budget (their tokens are in
            ``tokens_prefilled``).
        drift_recomputes: chunks whose most deviating tokens were recomputed to keep the drift
            budget (the budget's cheapest fix; tokens and forwards in ``tokens_prefilled`` and
            ``forwards``).
        drift: the largest estimated drift of any chunk after the op (0: every chunk exact;
            summed costs keep the largest).
        seconds: wall time.
    """

    forwards: int = 0
    tokens_prefilled: int = 0
    tokens_reused: int = 0
    tokens_placed: int = 0
    vision_encodes: int = 0
    canonicals_formed: int = 0
    reforms: int = 0
    patches_formed: int = 0
    patches_applied: int = 0
    bytes_added: int = 0
    uncached: int = 0
    forgotten: int = 0
    probes: int = 0
    audits: int = 0
    audit_tokens: int = 0
    drift_fixes: int = 0
    drift_recomputes: int = 0
    drift: float = 0.0
    seconds: float = 0.0

    @property
    def reencodes(self) -> int:
        """Deprecated name of `reforms`."""
        warnings.warn("OpCost.reencodes is now OpCost.reforms", DeprecationWarning, stacklevel=2)
        return self.reforms

    def __add__(self, other: OpCost) -> OpCost:
        summed = {name: getattr(self, name) + getattr(other, name) for name in _SUMMED}
        return OpCost(**summed, drift=max(self.drift, other.drift))


_SUMMED = tuple(f.name for f in fields(OpCost) if f.name != "drift")
"""The `OpCost` fields that add up (named once: ``fields()`` per sum was half its cost)."""


@dataclass(frozen=True)
class TokenLogprob:
    """One answer token's log-probability and the most likely alternatives at its step.

    Attributes:
        token: the chosen token id.
        logprob: its log-probability under the scores it was chosen from (the model's logits
            after ``logit_bias`` and the penalties; before temperature, top-k and top-p).
        top: ``(token id, logprob)`` of the most likely tokens at that step, most likely first
            (as many as asked for: ``top_logprobs``).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Answer:
    """A decoded answer.

    Attributes:
        text: the generated text (special tokens and stop string removed).
        tokens: generated token ids.
        logits: ``[steps, vocab]`` float32 logits of each generated step, if asked for.
        first_logits: ``[vocab]`` logits of the first generated token (always kept: the basis of
            fidelity checks such as KL to re-prefill).
        finish_reason: ``"eos"``, ``"stop"``, ``"length"`` or ``"cancelled"`` (``keep_going`` said stop).
        cost: what producing it cost, when it came from a window operation.
        logprobs: one `TokenLogprob` per token in ``tokens``, when asked for (``top_logprobs``).
    """

    text: str
    tokens: list[int]
    first_logits: torch.Tensor
    logits: torch.Tensor | None = None
    finish_reason: str = "length"
    cost: OpCost | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class WindowStats:
    """Per-op and cumulative costs of a window.

    Attributes:
        last: the most recent operation's cost.
        total: everything since the window was made.
        by_op: cumulative cost per operation name (``push``, ``slide``, ``ask`` ...).
        ops: how many times each operation ran.
    """

    last: OpCost = field(default_factory=OpCost)
    total: OpCost = field(default_factory=OpCost)
    by_op: dict[str, OpCost] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)

    def __repr__(self) -> str:
        ops = ", ".join(f"{op}×{n}" for op, n in self.ops.items()) or "none"
        t = self.total
        return (
            f"WindowStats(ops: {ops}; total: {t.forwards} forwards, {t.tokens_prefilled:,} tokens "
            f"prefilled, {t.tokens_reused:,} reused, {t.vision_encodes} vision encodes, {t.seconds:.3f} s; "
            f"last: {self.last})"
        )


@dataclass(frozen=True)
class Edit:
    """One cache edit a window operation implies.

    Attributes:
        kind: ``form_canonical`` (canonical prefill), ``rotate`` (relocation only), ``apply_patch`` (a stored
            patch, no forward), ``form_patch`` (a conditioned forward + SVD), ``revert`` (back to the
            canonical), ``defer`` (patch formed before the next read), ``admit`` / ``recall`` / ``evict``.
        label: the chunk's label (or id).
        detail: why, in words.
        forwards: forwards this edit runs.
        tokens: tokens those forwards prefill.
        ref: the window's `ChunkRef` of the chunk (``None`` where an edit names none, a probe's
            eviction); not part of an edit's equality.
    """

    kind: EditKind
    label: str
    detail: str = ""
    forwards: int = 0
    tokens: int = 0
    ref: Hashable | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Plan:
    """The edits an operation implies, computed before anything is done (``window.plan``)."""

    op: str
    edits: tuple[Edit, ...]

    @property
    def forwards(self) -> int:
        return sum(edit.forwards for edit in self.edits)

    @property
    def tokens_prefilled(self) -> int:
        return sum(edit.tokens for edit in self.edits)

    def count(self, kind: EditKind) -> int:
        return sum(edit.kind == kind for edit in self.edits)


@dataclass(frozen=True)
class Probe:
    """Is a chunk still load-bearing for a query? The window's answer with and without it.

    Attributes:
        with_chunk: the answer over the current window.
        without_chunk: the answer with the chunk's influence switched off.
        kl: next-token KL(with ‖ without) of the first answer token.
        top1_agree: both put the same token first.
        disposable: ``kl`` is below the window's ``probe_threshold``.
        cost: what the probe spent: its decodes, and the forward that forms the chunks after the
            one switched off where the store holds nothing for their reduced context.
    """

    with_chunk: Answer
    without_chunk: Answer
    kl: float
    top1_agree: bool
    disposable: bool
    cost: OpCost
