"""Fidelity suite: does every reuse arm answer the held-out demo items as re-prefill does?

Why this suite: speed means nothing if reused KV answers differently. Every arm (blind
relocation, CacheBlend- and EPIC-style selective recompute, kamera patches of rank 1 … 64,
full rank, deep-half and orbit patches) serves the same items in one process, one re-prefill
forward per item giving the reference; the figures are `kamera_agent.demo.evaluate`'s.

The **sparse-binding control** runs the token-recompute arms on items whose pages hold only a
few glyphs (`kamera_agent.demo.task`): there the few tokens that bind are the few that deviate,
so selective recompute should repair the page. It shows the baselines are not rigged.

Items are evaluated one at a time and merged into the running tally, so an interrupted run
keeps every item it finished.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from rich.progress import Progress

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.common import finite
from kamera_agent.demo.evaluate import (
    RECOMPUTE_ARMS,
    ArmResult,
    Evaluation,
    Recompute,
    canonical_core,
    evaluate,
)
from kamera_agent.demo.sequences import FrameCache, item_sequence
from kamera_agent.demo.task import DemoItem

__all__ = [
    "CONTROL_ARMS",
    "FIDELITY_ARMS",
    "RANKS",
    "RANK_ARMS",
    "SWEEP_ARMS",
    "ArmFigures",
    "FidelityRun",
    "Spend",
    "run_fidelity",
]

RANKS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
RANK_ARMS: tuple[str, ...] = tuple(f"rank-{m}" for m in RANKS)
SWEEP_ARMS: tuple[str, ...] = (
    *(f"cacheblend-chunk-{p}" for p in (5, 30, 50)),
    *(f"cacheblend-global-{p}" for p in (5, 15, 30, 50)),
    *(f"epic-{k}" for k in (4, 8, 16, 32)),
    "cacheblend-bytes-16",
)
"""Token-recompute baselines across recomputed shares (``cacheblend`` is ``cacheblend-chunk-15``)."""

FIDELITY_ARMS: tuple[str, ...] = (
    "blind",
    "cacheblend",
    "epic",
    *SWEEP_ARMS,
    *RANK_ARMS,
    "full",
    "rank-16-deep",
    "orbit-16",
)
"""The arms of the suite; ``reprefill`` (the reference) is always reported too."""

CONTROL_ARMS: tuple[str, ...] = ("blind", "cacheblend", "cacheblend-global-15", "epic", "rank-16")
"""The arms of the sparse-binding control: the token-recompute arms at 15 % beside kamera."""

# What each arm spends besides the canonical: patch factors (rank, layer share) or recomputed tokens.
_PATCHES: Mapping[str, tuple[int | None, float]] = MappingProxyType(
    {
        **{f"rank-{m}": (m, 1.0) for m in RANKS},
        "full": (None, 1.0),
        "rank-16-deep": (16, 0.5),
        "orbit-16": (16, 1.0),
    }
)
_TALLIES = ("items", "correct", "kl_sum", "agree", "flips", "flips_recovered")


@dataclass(frozen=True)
class Spend:
    """What an arm spends per chunk beyond its canonical KV, as shares of the chunk.

    Attributes:
        stored: bytes kept besides the canonical (patch factors) / the chunk's KV bytes.
        recomputed: tokens recomputed in context at reuse / the chunk's tokens.
    """

    stored: float = 0.0
    recomputed: float = 0.0


@dataclass(frozen=True)
class ArmFigures:
    """One arm over the items: accuracy (pooled, multi-hop, single-hop glyph), KL, η, agreement."""

    arm: str
    accuracy: float
    multi_hop_accuracy: float
    glyph_accuracy: float
    kl: float
    eta: float
    eta_multi_hop: float
    top1_agreement: float
    flip_recovery: float
    spend: Spend
    binding_ci: tuple[float, float] = (float("nan"), float("nan"))
    kl_ci: tuple[float, float] = (float("nan"), float("nan"))
    eta_ci: tuple[float, float] = (float("nan"), float("nan"))


@dataclass
class FidelityRun:
    """The suite's live state: filled item by item (an interrupted run keeps what finished)."""

    model: str
    seed: int
    items_requested: int
    arms: tuple[str, ...] = FIDELITY_ARMS
    evaluation: Evaluation = field(default_factory=Evaluation)
    items_done: int = 0
    seconds: float = 0.0
    chunk_tokens: list[int] = field(default_factory=list)
    features: tuple[int, int] = (0, 0)
    """Numbers per token in the key and the value slot (heads·dim)."""
    spends: dict[str, Spend] = field(default_factory=dict)
    control: Evaluation = field(default_factory=Evaluation)
    """The sparse-binding control's tallies (`CONTROL_ARMS`)."""
    control_items_done: int = 0

    def figures(self) -> list[ArmFigures]:
        """Per arm (re-prefill first), the figures over the items finished so far, with 95 %
        bootstrap intervals (items resampled, the same draws for every arm)."""
        ev = self.evaluation
        intervals = _intervals(ev, ("reprefill", *self.arms))
        return [
            ArmFigures(
                arm=arm,
                accuracy=ev.result(arm).accuracy,
                multi_hop_accuracy=ev.multi_hop(arm).accuracy,
                glyph_accuracy=ev.result(arm, "glyph").accuracy,
                kl=ev.result(arm).mean_kl,
                eta=ev.gap_closed(arm),
                eta_multi_hop=_gap_closed(ev.multi_hop(arm), ev.multi_hop("blind")),
                top1_agreement=ev.result(arm).top1_agreement,
                flip_recovery=ev.result(arm).flip_recovery,
                spend=self.spends.get(arm, Spend()),
                **intervals.get(arm, {}),
            )
            for arm in ("reprefill", *self.arms)
        ]

    def figure(self, arm: str) -> ArmFigures:
        return next(f for f in self.figures() if f.arm == arm)

    def page_share(self, arm: str) -> float:
        """What ``arm`` stores for the largest chunk (a page), as a share of that chunk's KV."""
        page = max(self.chunk_tokens, default=0)
        return arm_spends((arm,), [page], self.features)[arm].stored if page else float("nan")

    def control_figures(self) -> list[tuple[str, float, float]]:
        """Per control arm (re-prefill first): binding accuracy and η on the sparse control."""
        ev = self.control
        if not self.control_items_done:
            return []
        return [
            (arm, ev.multi_hop(arm).accuracy, _gap_closed(ev.multi_hop(arm), ev.multi_hop("blind")))
            for arm in ("reprefill", *CONTROL_ARMS)
        ]

    def to_json(self) -> dict[str, Any]:
        arms = []
        for fig in self.figures():
            row: dict[str, Any] = {k: v for k, v in vars(fig).items() if k != "spend"}
            row = {k: _jsonable(v) for k, v in row.items()}
            arms.append({**row, "stored_share": fig.spend.stored, "recomputed_share": fig.spend.recomputed})
        deficit = self.evaluation.deficit
        pages = max(deficit.chunks, 1)
        return {
            "model": self.model,
            "seed": self.seed,
            "items_requested": self.items_requested,
            "items_done": self.items_done,
            "seconds": self.seconds,
            "chunk_tokens": self.chunk_tokens,
            "arms": arms,
            "deficit": {
                "pages": deficit.chunks,
                "energy_by_layer": [e / pages for e in deficit.energy],
                "relative_by_layer": [r / pages for r in deficit.relative],
                "deep_over_shallow_energy": finite(deficit.deep_over_shallow),
                "rank90_median": _median(deficit.rank90),
                "rank90_range": [min(deficit.rank90, default=0), max(deficit.rank90, default=0)],
                "order_change_median": _median(deficit.order_change),
            },
            "control": {
                "items_done": self.control_items_done,
                "arms": [
                    {"arm": arm, "binding_accuracy": acc, "eta_binding": finite(eta)}
                    for arm, acc, eta in self.control_figures()
                ],
            },
        }


def run_fidelity(
    backend: TransformersBackend,
    items: Sequence[DemoItem],
    run: FidelityRun,
    progress: Progress,
    control: Sequence[DemoItem] = (),
) -> None:
    """Evaluate every arm on ``items``, then `CONTROL_ARMS` on the sparse ``control`` items, one
    item at a time.

    Mutates: ``run`` (tallies, items done, spends, seconds) after every finished item.
    """
    frames, core = FrameCache(backend.encoder), canonical_core(backend)
    if items:
        chunks = item_sequence(frames, items[0]).chunks
        run.chunk_tokens = [chunk.num_tokens for chunk in chunks]
        run.features = _features(backend)
        run.spends = arm_spends(run.arms, run.chunk_tokens, run.features)
    task = progress.add_task(f"fidelity · {len(run.arms)} arms", total=len(items))
    began = time.perf_counter()
    for item in items:
        _merge(run.evaluation, evaluate(backend, [item], run.arms, cache=frames, core=core))
        run.items_done += 1
        run.seconds = time.perf_counter() - began
        progress.advance(task)
    if not control:
        return
    task = progress.add_task(f"sparse-binding control · {len(CONTROL_ARMS)} arms", total=len(control))
    for item in control:
        _merge(run.control, evaluate(backend, [item], CONTROL_ARMS, cache=frames, core=core))
        run.control_items_done += 1
        run.seconds = time.perf_counter() - began
        progress.advance(task)


def arm_spends(arms: Sequence[str], chunk_tokens: Sequence[int], features: Sequence[int]) -> dict[str, Spend]:
    """Each arm's spend over chunks of ``chunk_tokens`` tokens with ``features`` (heads·dim of the
    key and the value slot): a rank-m patch keeps ``min(m, n, F)·(n + F)`` numbers per layer and
    slot against the chunk's ``n·F``; a recompute arm recomputes the tokens its `Recompute` counts."""
    kv = sum(chunk_tokens) * sum(features)
    spends = {}
    for arm in ("reprefill", *arms):
        if arm in _PATCHES:
            rank, layers = _PATCHES[arm]
            stored = sum(min(rank or n, n, f) * (n + f) for n in chunk_tokens for f in features)
            spends[arm] = Spend(stored=layers * stored / kv)
        elif arm == "reprefill":
            spends[arm] = Spend(recomputed=1.0)
        elif arm in RECOMPUTE_ARMS:
            spec = RECOMPUTE_ARMS[arm]
            spends[arm] = Spend(recomputed=_recomputed_share(spec, chunk_tokens, max(features)))
        else:
            spends[arm] = Spend()
    return spends


def _recomputed_share(spec: Recompute, chunk_tokens: Sequence[int], features: int) -> float:
    total = sum(chunk_tokens)
    if spec.scope == "global":
        return round(spec.share * total) / total
    return sum(spec.count(n, features) for n in chunk_tokens) / total


def _features(backend: TransformersBackend) -> tuple[int, int]:
    (k_heads, k_dim), (v_heads, v_dim) = backend.layout.keys_shape, backend.layout.values_shape
    return int(k_heads * k_dim), int(v_heads * v_dim)


def _merge(total: Evaluation, part: Evaluation) -> None:
    """Add one item's tallies into the running evaluation."""
    for kind, arms in part.by_kind.items():
        for arm, tally in arms.items():
            into = total.result(arm, kind)
            for name in _TALLIES:
                setattr(into, name, getattr(into, name) + getattr(tally, name))
            into.outcomes += tally.outcomes
    total.deficit.add(part.deficit)


BOOTSTRAP_DRAWS = 1000


def _intervals(ev: Evaluation, arms: Sequence[str]) -> dict[str, dict[str, tuple[float, float]]]:
    """95 % bootstrap intervals of binding accuracy, KL and η per arm: items resampled with
    replacement, the same draws for every arm (η's blind KL from the same draw)."""
    blind = ev.result("blind").outcomes
    n = len(blind)
    if n < 2:
        return {}
    draws = torch.randint(n, (BOOTSTRAP_DRAWS, n), generator=torch.Generator().manual_seed(0))
    blind_kl = torch.tensor([kl for _, kl in blind], dtype=torch.float64)[draws].mean(1)
    binding = ev.multi_hop("blind").outcomes
    m = len(binding)
    seeded = torch.Generator().manual_seed(1)
    binding_draws = torch.randint(m, (BOOTSTRAP_DRAWS, m), generator=seeded) if m else None
    out = {}
    for arm in arms:
        outcomes = ev.result(arm).outcomes
        if len(outcomes) != n:
            continue
        kl = torch.tensor([k for _, k in outcomes], dtype=torch.float64)[draws].mean(1)
        eta = 1.0 - kl / blind_kl.clamp_min(1e-30)
        row = {"kl_ci": _quantiles(kl), "eta_ci": _quantiles(eta)}
        hop = ev.multi_hop(arm).outcomes
        if binding_draws is not None and len(hop) == m:
            right = torch.tensor([float(c) for c, _ in hop], dtype=torch.float64)[binding_draws].mean(1)
            row["binding_ci"] = _quantiles(right)
        out[arm] = row
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return finite(value)
    if isinstance(value, tuple):
        return [finite(v) for v in value]
    return value


def _quantiles(values: torch.Tensor) -> tuple[float, float]:
    low, high = torch.quantile(values, torch.tensor([0.025, 0.975], dtype=values.dtype)).tolist()
    return float(low), float(high)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return float(ordered[mid]) if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _gap_closed(arm: ArmResult, blind: ArmResult) -> float:
    return 1.0 - arm.mean_kl / blind.mean_kl if blind.mean_kl > 0 else float("nan")
