"""Drift: how far a chunk's reused KV is from what a re-prefill of its arrangement computes.

Why estimated: the exact error of a reused chunk (its relative KV error against the model's
own re-prefill of the window) costs a re-prefill to measure, which is what reuse avoids. What
calibrates on the shipped model (`benchmarks/drift_estimator.py`) is a **sampled audit**: a
random share of the chunk's tokens recomputed through every layer over the window's own
context (`Backend.recompute`), the chunk's KV measured against them on those rows. It misses
what the context itself carries (an approximate chunk to the left), so an estimate adds a share
of the largest estimate before it:

    estimate(i) = scale × audit(i) + inherit × max(estimate(j) for j < i)

``scale`` and ``inherit`` are a model's `Calibration`, fitted once on episodes disjoint from
every benchmark it is judged on (``kamera calibrate``) and filed by the model's fingerprint:
never another model's constants. An audit is a function of what the chunk's KV and its left
context encode (their chained states), so it is measured once per pair and remembered.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store.audits import DriftAudit

if TYPE_CHECKING:
    from kamera_agent.core.kv_core import KVCore, Txn

__all__ = [
    "AuditSource",
    "Filed",
    "Measure",
    "audit",
    "audit_count",
    "audit_indices",
    "filed_in",
    "relative_error",
    "sampled_error",
]

Measure = Callable[[int, ChunkState, Context], float]
"""Audit the chunk at index ``i`` in ``state`` behind left context ``ctx``: its sampled error."""

Filed = Callable[[ChunkState, Context], float | None]
"""The error an audit filed in the store measured for ``state`` behind ``ctx``, or ``None``."""


def audit_count(num_tokens: int, share: float) -> int:
    """How many token rows one audit of a ``num_tokens`` chunk recomputes: ``share`` of them, at
    least two, at most all (what the planner and the runner charge an audit before running it)."""
    return min(num_tokens, max(2, math.ceil(share * num_tokens)))


def audit_indices(num_tokens: int, share: float, seed: str) -> torch.Tensor:
    """The sorted token indices one audit recomputes: ``share`` of the chunk (at least two, at most
    all), drawn reproducibly from ``seed`` (what the chunk and its context encode): the same pair
    is audited on the same rows wherever it is measured."""
    count = audit_count(num_tokens, share)
    draw = int(hashlib.blake2b(seed.encode(), digest_size=8).hexdigest(), 16)
    generator = torch.Generator().manual_seed(draw)
    return torch.randperm(num_tokens, generator=generator)[:count].sort().values


def relative_error(kv: ChunkKV, truth: ChunkKV) -> float:
    """``‖kv − truth‖ / ‖truth‖`` over keys and values of every layer (float32)."""
    num = (kv.keys.float() - truth.keys.float()).pow(2).sum() + (
        kv.values.float() - truth.values.float()
    ).pow(2).sum()
    den = truth.keys.float().pow(2).sum() + truth.values.float().pow(2).sum()
    return float((num / den.clamp_min(1e-30)).sqrt())


def sampled_error(kv: ChunkKV, audited: ChunkKV, indices: torch.Tensor) -> float:
    """`relative_error` of ``kv`` against ``audited`` on the audited token rows only."""
    rows = (slice(None), slice(None), indices.to(kv.keys.device))
    return relative_error(
        ChunkKV(kv.keys[rows], kv.values[rows]), ChunkKV(audited.keys[rows], audited.values[rows])
    )


def audit(
    core: KVCore,
    chunk: Chunk,
    kv: ChunkKV,
    context: Sequence[ChunkKV],
    start: int,
    share: float,
    seed: str,
    txn: Txn,
) -> tuple[float, int]:
    """One sampled audit of ``kv`` (the chunk placed at ``start`` behind ``context``): its relative
    error on `audit_indices` rows against those rows recomputed through every layer over
    ``context`` (`Backend.recompute`; its cost lands in ``txn.meter``), and the tokens audited."""
    core.check_origin(chunk)
    vision = core.vision(chunk, txn) if chunk.has_vision else None
    indices = audit_indices(chunk.num_tokens, share, seed)
    done = core.backend.recompute(chunk, kv, indices, context, start, vision)
    txn.meter.spend(done.spent)
    return sampled_error(kv, done.kv[0], indices), int(indices.numel())


class AuditSource(Protocol):
    """Where audits are filed: a `ChunkStore`, or an operation's staged view of one."""

    def get_audit(self, chunk_key: str, state: str, left: str) -> DriftAudit | None: ...


def filed_in(source: AuditSource) -> Callable[[ChunkState, Context], float | None]:
    """The error filed in ``source`` for a state behind a left context, or ``None`` (not measured)."""

    def filed(state: ChunkState, left: Context) -> float | None:
        found = source.get_audit(state.chunk_key, state.digest, left.digest)
        return None if found is None else found.error

    return filed
