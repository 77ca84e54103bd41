"""Fidelity of reuse arms on the demo task: accuracy, KL to re-prefill, gap closed, flips recovered.

Why one evaluator: the demo, the model card's numbers, the CI smoke test and ``kamera bench``
all ask the same question of the same items: with each chunk's KV served a given way, does
the window still answer like a full re-prefill? Arms are strategies registered by name:

- ``reprefill``: the model's own forward over the whole window (the reference);
- ``blind``: canonicals relocated, no conditioning (what position-independent caching gives);
- ``rank-m`` / ``full``: canonical + a rank-m (or exact) patch, relocated (kamera);
- ``cacheblend``: blind, with the 15 % of each chunk's tokens whose layer-1 KV deviates most
  recomputed in context (their true conditioned KV: the strongest form of selective recompute);
- ``epic``: blind, with each chunk's first tokens recomputed in context, at the same token
  budget (15 %) as ``cacheblend``;
- the sweeps (`RECOMPUTE_ARMS`): ``cacheblend-chunk-P`` / ``cacheblend-global-P`` (P % of each
  chunk's, or of the window's, tokens; P in `BUDGETS`), ``epic-K`` (each chunk's first K
  tokens) and ``cacheblend-bytes-16`` (as many tokens as a rank-16 patch's bytes);
- ``rank-16-deep``: a rank-16 patch on the deepest half of the layers only (where the deficit
  lives), half the bytes of ``rank-16``;
- ``orbit-16`` (`ORBIT_ARMS`): every chunk served with a rank-16 patch of its *mean* deficit
  over the item's ordering and one shuffled ordering of the legend frames, wherever its
  antecedent set is the same in both (the pages): what a window serves after a reorder.

One re-prefill forward per item gives the reference answer and every chunk's conditioned KV,
from which patches and the token baselines are built; each arm then costs one query decode.
Orbit arms add one forward per item (the shuffled ordering).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch

from kamera_agent.backends.transformers import TransformersBackend, read_chunk
from kamera_agent.compat import output_cache
from kamera_agent.core import CostMeter, KVCore
from kamera_agent.demo.sequences import FrameCache, ItemSequence, item_sequence
from kamera_agent.demo.task import DemoItem
from kamera_agent.metrics import next_token_kl
from kamera_agent.operator.layout import ChunkKV, KVLayout
from kamera_agent.operator.patch import LayerChoice, apply_patch, form_orbit_patch, form_patch
from kamera_agent.store import ChunkStore

__all__ = [
    "ARMS",
    "ORBIT_ARMS",
    "RECOMPUTE_ARMS",
    "ArmResult",
    "Evaluation",
    "Recompute",
    "arm_names",
    "canonical_core",
    "evaluate",
]

Arm = Callable[[ChunkKV, ChunkKV, KVLayout, torch.Tensor], ChunkKV]
"""(canonical, conditioned, layout, positions) → the chunk's KV as the arm serves it."""

OrbitArm = Callable[[ChunkKV, Sequence[ChunkKV], KVLayout, torch.Tensor], ChunkKV]
"""(canonical, conditioned KV under each ordering with its antecedent set (the item's own
first), layout, positions) → the chunk's KV as the arm serves it."""


def _blind(canonical: ChunkKV, conditioned: ChunkKV, layout: KVLayout, positions: torch.Tensor) -> ChunkKV:
    return apply_patch(canonical, None, layout, positions)


def _patched(rank: int | str, layers: LayerChoice = "all") -> Arm:
    def arm(canonical: ChunkKV, conditioned: ChunkKV, layout: KVLayout, positions: torch.Tensor) -> ChunkKV:
        patch = form_patch(canonical, conditioned, layout, rank, layers=layers)  # type: ignore[arg-type]
        return apply_patch(canonical, patch, layout, positions)

    return arm


def _orbit(rank: int) -> OrbitArm:
    def arm(
        canonical: ChunkKV, conditioned: Sequence[ChunkKV], layout: KVLayout, positions: torch.Tensor
    ) -> ChunkKV:
        patch = form_orbit_patch(canonical, conditioned, layout, rank)
        return apply_patch(canonical, patch, layout, positions)

    return arm


@dataclass(frozen=True)
class Recompute:
    """A token-recompute baseline: which of a chunk's tokens get their in-context KV.

    Both baselines are run at their best: a selected token gets its *true* conditioned KV (what
    a full re-prefill gives it), not KV recomputed over its blind neighbours as CacheBlend and
    EPIC compute it, so each figure is an upper bound of what the method can reach.

    Attributes:
        select: ``"deviation"`` (CacheBlend: the tokens whose layer-1 KV deviates most from
            blind) or ``"first"`` (EPIC: each chunk's first tokens).
        scope: ``"chunk"`` picks within each chunk, ``"global"`` across the window's chunks.
        share: the share of tokens recomputed (of each chunk, or of the window's).
        tokens: a token count per chunk instead of a share (EPIC's absolute k).
        rank: instead of a share, as many tokens per chunk as a rank-``rank`` patch of the
            chunk stores numbers (``rank·(n + F)`` against ``F`` per token): matched bytes.
    """

    select: Literal["deviation", "first"]
    scope: Literal["chunk", "global"] = "chunk"
    share: float = 0.15
    tokens: int | None = None
    rank: int | None = None

    def count(self, n: int, features: int) -> int:
        """Tokens recomputed in a chunk of ``n`` tokens (``features``: the widest slot's heads·dim)."""
        if self.rank is not None:
            rank = min(self.rank, n, features)
            return min(n, -(-rank * (n + features) // features))
        if self.tokens is not None:
            return min(n, self.tokens)
        return min(n, round(self.share * n))


def _deviation(blind: ChunkKV, conditioned: ChunkKV) -> torch.Tensor:
    """Per token: how far its layer-1 KV is from blind (CacheBlend's selection signal)."""
    layer = min(1, blind.keys.shape[0] - 1)
    keys = (conditioned.keys[layer] - blind.keys[layer]).float().norm(dim=(0, 2))
    values = (conditioned.values[layer] - blind.values[layer]).float().norm(dim=(0, 2))
    deviation: torch.Tensor = keys + values
    return deviation


def _recomputed(spec: Recompute, pieces: Sequence[Piece], layout: KVLayout) -> list[ChunkKV]:
    """Every chunk blind, with the tokens ``spec`` selects given their conditioned KV."""
    blinds = [apply_patch(c, None, layout, p) for c, _, p in pieces]
    features = layout.features
    if spec.scope == "global":
        scores = torch.cat([_deviation(b, k) for b, (_, k, _) in zip(blinds, pieces, strict=True)])
        chosen = torch.zeros_like(scores, dtype=torch.bool)
        count = min(scores.numel(), round(spec.share * scores.numel()))
        chosen[scores.topk(count).indices] = True
        rows = list(chosen.split([b.num_tokens for b in blinds]))
    else:
        rows = []
        for blind, (_, conditioned, _) in zip(blinds, pieces, strict=True):
            chosen = torch.zeros(blind.num_tokens, dtype=torch.bool)
            count = spec.count(blind.num_tokens, features)
            if spec.select == "first":
                chosen[:count] = True
            else:
                chosen[_deviation(blind, conditioned).topk(count).indices] = True
            rows.append(chosen)
    out = []
    for blind, (_, conditioned, _), chosen in zip(blinds, pieces, rows, strict=True):
        keys, values = blind.keys.clone(), blind.values.clone()
        keys[:, :, chosen] = conditioned.keys[:, :, chosen]
        values[:, :, chosen] = conditioned.values[:, :, chosen]
        out.append(ChunkKV(keys, values, blind.positions, blind.chunk_key, blind.model_fingerprint))
    return out


BUDGETS = (0, 5, 15, 30, 50, 100)
"""The token-recompute sweep's budgets, in percent (0: blind reuse; 100: a re-prefill)."""

RECOMPUTE_ARMS: Mapping[str, Recompute] = MappingProxyType(
    {
        "cacheblend": Recompute("deviation", share=0.15),
        "epic": Recompute("first", share=0.15),
        **{
            f"cacheblend-chunk-{p}": Recompute("deviation", "chunk", p / 100) for p in (0, 5, 15, 30, 50, 100)
        },
        **{
            f"cacheblend-global-{p}": Recompute("deviation", "global", p / 100)
            for p in (0, 5, 15, 30, 50, 100)
        },
        **{f"epic-{k}": Recompute("first", tokens=k) for k in (0, 4, 8, 16, 32)},
        "cacheblend-bytes-16": Recompute("deviation", rank=16),
    }
)
"""Token-recompute baselines (`Recompute`): CacheBlend-style per chunk and global at budgets
0–100 %, EPIC-style at absolute k, and CacheBlend at the bytes of a rank-16 patch."""


ARMS: Mapping[str, Arm] = MappingProxyType(
    {
        "blind": _blind,
        **{f"rank-{m}": _patched(m) for m in (1, 2, 4, 8, 16, 32, 64)},
        "full": _patched("full"),
        "rank-16-deep": _patched(16, layers="deep_half"),
    }
)

ORBIT_ARMS: Mapping[str, OrbitArm] = MappingProxyType({"orbit-16": _orbit(16)})
"""Arms that need each chunk's conditioned KV under more than one ordering (one extra forward)."""


def arm_names() -> list[str]:
    return ["reprefill", *ARMS, *RECOMPUTE_ARMS, *ORBIT_ARMS]


@dataclass
class ArmResult:
    """One arm's tallies over the items (per question kind in `Evaluation.by_kind`)."""

    items: int = 0
    correct: int = 0
    kl_sum: float = 0.0
    agree: int = 0
    flips: int = 0
    flips_recovered: int = 0

    @property
    def accuracy(self) -> float:
        return self.correct / self.items if self.items else 0.0

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.items if self.items else 0.0

    @property
    def top1_agreement(self) -> float:
        return self.agree / self.items if self.items else 0.0

    @property
    def flip_recovery(self) -> float:
        """Share of items where blind reuse changes the answer that this arm answers as re-prefill."""
        return self.flips_recovered / self.flips if self.flips else float("nan")


@dataclass
class Evaluation:
    """Results by arm and by question kind (``"all"``, ``"majority"``, ``"glyph"``)."""

    by_kind: dict[str, dict[str, ArmResult]] = field(default_factory=dict)

    def result(self, arm: str, kind: str = "all") -> ArmResult:
        return self.by_kind.setdefault(kind, {}).setdefault(arm, ArmResult())

    def multi_hop(self, arm: str) -> ArmResult:
        """The questions that need binding (majority colour)."""
        return self.result(arm, "majority")

    def gap_closed(self, arm: str, kind: str = "all") -> float:
        """η: the share of the blind→re-prefill KL gap the arm closes."""
        blind = self.result("blind", kind).mean_kl
        return 1.0 - self.result(arm, kind).mean_kl / blind if blind > 0 else float("nan")


def evaluate(
    backend: TransformersBackend,
    items: Sequence[DemoItem],
    arms: Sequence[str] = ("blind", "rank-2", "rank-16", "full"),
    on_item: Callable[[int], None] | None = None,
    *,
    cache: FrameCache | None = None,
    core: KVCore | None = None,
) -> Evaluation:
    """Answer every item with every arm; compare with re-prefill.

    ``cache`` and ``core`` let several calls share the frames' chunks and their canonicals (a
    caller that evaluates item by item, to keep finished items when interrupted, would
    otherwise rebuild them every call).
    """
    unknown = [arm for arm in arms if arm not in arm_names()]
    if unknown:
        raise ValueError(f"unknown arms {unknown}; known: {', '.join(arm_names())}")
    frames, result = cache or FrameCache(backend.encoder), Evaluation()
    core = core or canonical_core(backend)
    for index, item in enumerate(items):
        _evaluate_item(core, backend, item_sequence(frames, item), arms, result)
        if on_item is not None:
            on_item(index)
    return result


Piece = tuple[ChunkKV, ChunkKV, torch.Tensor]
"""(canonical, conditioned in the item's own ordering, positions) of one chunk."""


def canonical_core(backend: TransformersBackend) -> KVCore:
    """A core over its own store: the evaluator's canonicals, kept across items."""
    return KVCore(backend, ChunkStore(fingerprint=backend.fingerprint, memory_budget=1 << 30))


def _evaluate_item(
    core: KVCore, backend: TransformersBackend, seq: ItemSequence, arms: Sequence[str], out: Evaluation
) -> None:
    inputs = backend.reference_inputs(seq.chunks, seq.query_ids)
    with torch.no_grad():
        forward = backend.model(**inputs, use_cache=True)
    reference = forward.logits[0, -1].float().cpu()
    pieces, start = _pieces(core, backend, seq, output_cache(forward))
    orbit = _orbit_members(backend, seq, pieces) if any(a in ORBIT_ARMS for a in arms) else []
    served = {"reprefill": reference}
    for name in arms:
        chunks = _serve(name, pieces, orbit, backend.layout)
        query_positions = backend.positions.text(start, int(seq.query_ids.shape[0]))
        anchor = core.anchor_kv(CostMeter())
        _, last = backend.forward_tokens(seq.query_ids, query_positions, backend.assemble([anchor, *chunks]))
        assert last is not None
        served[name] = last.cpu()
    _tally(seq, reference, served, out)


def _serve(
    name: str, pieces: Sequence[Piece], orbit: Sequence[Sequence[ChunkKV]], layout: KVLayout
) -> list[ChunkKV]:
    """Every chunk's KV as arm ``name`` serves it."""
    if name in ORBIT_ARMS:
        arm = ORBIT_ARMS[name]
        return [arm(c, members, layout, p) for (c, _, p), members in zip(pieces, orbit, strict=True)]
    if name in RECOMPUTE_ARMS:
        return _recomputed(RECOMPUTE_ARMS[name], pieces, layout)
    return [ARMS[name](c, k, layout, p) for c, k, p in pieces]


def _pieces(
    core: KVCore, backend: TransformersBackend, seq: ItemSequence, truth: Any
) -> tuple[list[Piece], int]:
    """Every chunk's canonical, conditioned KV and positions; and where the query starts."""
    slot, start = backend.anchor.num_tokens, backend.anchor.advance
    pieces: list[Piece] = []
    for chunk in seq.chunks:
        positions = chunk.positions_at(start)
        conditioned = read_chunk(truth, backend.layout, slot, slot + chunk.num_tokens, positions)
        with core.txn() as txn:
            pieces.append((core.canonical(chunk, txn), conditioned, positions))
        slot, start = slot + chunk.num_tokens, start + chunk.advance
    return pieces, start


def _orbit_members(
    backend: TransformersBackend, seq: ItemSequence, pieces: Sequence[Piece]
) -> list[list[ChunkKV]]:
    """Per chunk: its conditioned KV in the item's ordering, plus in one shuffled ordering of the
    legend frames wherever its antecedent set is the same there (the pages)."""
    order = _shuffled_legend(seq)
    inputs = backend.reference_inputs([seq.chunks[i] for i in order])
    with torch.no_grad():
        truth = output_cache(backend.model(**inputs, use_cache=True))
    members = [[conditioned] for _, conditioned, _ in pieces]
    slot, start = backend.anchor.num_tokens, backend.anchor.advance
    for j, i in enumerate(order):
        chunk = seq.chunks[i]
        if set(order[:j]) == set(range(i)):
            positions = chunk.positions_at(start)
            members[i].append(read_chunk(truth, backend.layout, slot, slot + chunk.num_tokens, positions))
        slot, start = slot + chunk.num_tokens, start + chunk.advance
    return members


def _shuffled_legend(seq: ItemSequence) -> list[int]:
    """Chunk indices with the legend frames in another order, drawn from the item itself."""
    legend = list(range(len(seq.item.legend)))
    order, rng = list(legend), random.Random(repr(seq.item))
    while order == legend and len(legend) > 1:
        rng.shuffle(order)
    return order + list(range(len(legend), len(seq.chunks)))


def _tally(
    seq: ItemSequence, reference: torch.Tensor, served: dict[str, torch.Tensor], out: Evaluation
) -> None:
    answer_token, truth_top = int(seq.answer_ids[0]), int(reference.argmax())
    flipped = "blind" in served and int(served["blind"].argmax()) != truth_top
    for name, logits in served.items():
        top = int(logits.argmax())
        for kind in ("all", seq.item.kind):
            tally = out.result(name, kind)
            tally.items += 1
            tally.correct += top == answer_token
            tally.kl_sum += next_token_kl(reference, logits)
            tally.agree += top == truth_top
            tally.flips += flipped
            tally.flips_recovered += flipped and top == truth_top
