"""Fidelity of reuse arms on the demo task: accuracy, KL to re-prefill, gap closed, flips recovered.

Why one evaluator: the demo, the model card's numbers, the CI smoke test and ``kamera bench``
all ask the same question of the same items: with each chunk's KV served a given way, does
the window still answer like a full re-prefill? Arms are strategies registered by name:

- ``reprefill``: the model's own forward over the whole window (the reference);
- ``blind``: canonicals relocated, no conditioning (what position-independent caching gives);
- ``rank-m`` / ``full``: canonical + a rank-m (or exact) patch, relocated (kamera);
- ``cacheblend``: blind, with the 15 % of each chunk's tokens whose KV deviates most (over every
  layer) recomputed in context (their true conditioned KV: the strongest form of selective recompute);
- ``epic``: blind, with each chunk's first tokens recomputed in context, at the same share
  of tokens (15 %) as ``cacheblend``;
- the sweeps (`RECOMPUTE_ARMS`): ``cacheblend-chunk-P`` / ``cacheblend-global-P`` (P % of each
  chunk's, or of the window's, tokens; P in `SHARES`), ``epic-K`` (each chunk's first K
  tokens) and ``cacheblend-bytes-16`` (as many tokens as a rank-16 patch's bytes);
- ``rank-16-deep``: a rank-16 patch on the deepest half of the layers only (where the deficit
  lives), half the bytes of ``rank-16``;
- ``orbit-16`` (`ORBIT_ARMS`): every chunk served with a rank-16 patch of its *mean* deficit
  over other orderings of the legend frames (never the item's own: the arm is scored on an
  ordering held out), wherever its antecedent set is the same there (the pages): what a window
  serves after a reorder to an ordering it had not seen.

One re-prefill forward per item gives the reference answer and every chunk's conditioned KV,
from which patches and the token baselines are built; each arm then costs one query decode.
Orbit arms add one forward per other ordering and item (`HELD_OUT_ORDERS` at most).
"""

from __future__ import annotations

import itertools
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
from kamera_agent.divergence import next_token_kl
from kamera_agent.operator.layout import ChunkKV, KVLayout, to_position_free
from kamera_agent.operator.patch import LayerChoice, apply_patch, form_patch
from kamera_agent.store import ChunkStore

__all__ = [
    "ARMS",
    "ORBIT_ARMS",
    "RECOMPUTE_ARMS",
    "ArmResult",
    "Deficit",
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
        patch = form_patch(canonical, list(conditioned), layout, rank)
        return apply_patch(canonical, patch, layout, positions)

    return arm


@dataclass(frozen=True)
class Recompute:
    """A token-recompute baseline: which of a chunk's tokens get their in-context KV.

    Both baselines are run at their best: a selected token gets its *true* conditioned KV (what
    a full re-prefill gives it), not KV recomputed over its blind neighbours as CacheBlend and
    EPIC compute it, so each figure is an upper bound of what the method can reach.

    Attributes:
        select: ``"deviation"`` (CacheBlend: the tokens whose KV deviates most from blind,
            over every layer) or ``"first"`` (EPIC: each chunk's first tokens).
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
    """Per token: how far its KV is from blind over every layer (CacheBlend's selection signal at
    its best: CacheBlend scores layer 1 and narrows the choice layer by layer; where a model binds
    above its first layers, layer 1 barely deviates and would choose almost at random)."""
    keys = (conditioned.keys - blind.keys).float().pow(2).sum(dim=(0, 1, 3)).sqrt()
    values = (conditioned.values - blind.values).float().pow(2).sum(dim=(0, 1, 3)).sqrt()
    deviation: torch.Tensor = keys + values
    return deviation


def _recomputed(spec: Recompute, pieces: Sequence[PageKV], layout: KVLayout) -> list[ChunkKV]:
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


SHARES = (0, 5, 15, 30, 50, 100)
"""The token-recompute sweep's recomputed shares, in percent (0: blind reuse; 100: a re-prefill)."""

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
        **{f"epic-{k}": Recompute("first", tokens=k) for k in (0, 4, 8, 16, 32, 128)},
        "cacheblend-bytes-16": Recompute("deviation", rank=16),
    }
)
"""Token-recompute baselines (`Recompute`): CacheBlend-style per chunk and global at shares
0–100 %, EPIC-style at absolute k (128: every token of the demo's chunks), and CacheBlend at the
bytes of a rank-16 patch."""


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
    outcomes: list[tuple[bool, float]] = field(default_factory=list)
    """Per item, in evaluation order: (answered right, KL to re-prefill), for intervals."""

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
class Deficit:
    """Where the pages' conditioning deficit lives: ``Δ = KV(page | legend) − KV(page | ∅)``,
    position-free, per layer and slot as an ``[tokens, heads·dim]`` matrix.

    Attributes:
        chunks: pages measured.
        energy: per layer, the summed ``‖Δ‖²`` (both slots).
        relative: per layer, the summed ``‖Δ‖ / ‖KV(page | legend)‖`` (divide by ``chunks``).
        rank90: per page, layer and slot, how many singular directions hold 90 % of ``‖Δ‖²``.
        order_change: per page and other ordering of the legend, ``‖Δπ − Δ‖ / ‖Δ‖`` over all
            layers: how much the deficit depends on the antecedents' order (the paper: 0.43–0.53).
    """

    chunks: int = 0
    energy: list[float] = field(default_factory=list)
    relative: list[float] = field(default_factory=list)
    rank90: list[int] = field(default_factory=list)
    order_change: list[float] = field(default_factory=list)

    def add(self, other: Deficit) -> None:
        """Sum ``other`` into this tally."""
        self.chunks += other.chunks
        self.energy = _sums(self.energy, other.energy)
        self.relative = _sums(self.relative, other.relative)
        self.rank90 += other.rank90
        self.order_change += other.order_change

    @property
    def deep_over_shallow(self) -> float:
        """Mean energy per layer in the deeper half of the layers over the shallower half's, the
        shallower half's mean taken over the layers that see context (layer 0's KV is its
        tokens' embeddings projected: no context can change it, so counting it would flatter)."""
        half = len(self.energy) // 2
        shallow, deep = self.energy[1:half], self.energy[half:]
        if not shallow or sum(shallow) <= 0:
            return float("nan")
        return (sum(deep) / len(deep)) / (sum(shallow) / len(shallow))


def _sums(a: list[float], b: list[float]) -> list[float]:
    return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0.0)]


@dataclass
class Evaluation:
    """Results by arm and by question kind (``"all"``, ``"colour"``, ``"glyph"``), and where
    the pages' deficit lives."""

    by_kind: dict[str, dict[str, ArmResult]] = field(default_factory=dict)
    deficit: Deficit = field(default_factory=Deficit)

    def result(self, arm: str, kind: str = "all") -> ArmResult:
        return self.by_kind.setdefault(kind, {}).setdefault(arm, ArmResult())

    def multi_hop(self, arm: str) -> ArmResult:
        """The questions that need binding (the colour no page shows)."""
        return self.result(arm, "colour")

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


PageKV = tuple[ChunkKV, ChunkKV, torch.Tensor]
"""(canonical, conditioned in the item's own ordering, positions) of one chunk."""


def canonical_core(backend: TransformersBackend) -> KVCore:
    """A core over its own store: the evaluator's canonicals, kept across items."""
    return KVCore(backend, ChunkStore(fingerprint=backend.fingerprint, memory_limit=1 << 30))


def _evaluate_item(
    core: KVCore, backend: TransformersBackend, seq: ItemSequence, arms: Sequence[str], out: Evaluation
) -> None:
    inputs = backend.reference_inputs(seq.chunks, seq.query_ids)
    with torch.no_grad():
        forward = backend.model(**inputs, use_cache=True)
    reference = forward.logits[0, -1].float().cpu()
    pieces, start = _pieces(core, backend, seq, output_cache(forward))
    first_page = len(seq.item.legend)
    out.deficit.add(_deficit(pieces[first_page:], backend.layout))
    orbit = _orbit_members(backend, seq, pieces) if any(a in ORBIT_ARMS for a in arms) else []
    for (canonical, own, _), members in zip(pieces[first_page:], orbit[first_page:], strict=False):
        out.deficit.order_change += _order_change(canonical, own, members, backend.layout)
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
    name: str, pieces: Sequence[PageKV], orbit: Sequence[Sequence[ChunkKV]], layout: KVLayout
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
) -> tuple[list[PageKV], int]:
    """Every chunk's canonical, conditioned KV and positions; and where the query starts."""
    slot, start = backend.anchor.num_tokens, backend.anchor.advance
    pieces: list[PageKV] = []
    for chunk in seq.chunks:
        positions = chunk.positions_at(start)
        conditioned = read_chunk(truth, backend.layout, slot, slot + chunk.num_tokens, positions)
        with core.txn() as txn:
            pieces.append((core.canonical(chunk, txn), conditioned, positions))
        slot, start = slot + chunk.num_tokens, start + chunk.advance
    return pieces, start


def _orbit_members(
    backend: TransformersBackend, seq: ItemSequence, pieces: Sequence[PageKV]
) -> list[list[ChunkKV]]:
    """Per chunk: its conditioned KV under other orderings of the legend frames (up to
    `HELD_OUT_ORDERS`, never the item's own) wherever its antecedent set is the same there (the
    pages), so the orbit arm is scored on an ordering it did not average over; a chunk no other
    ordering gives the same antecedent set keeps its own conditioned KV (a window forms that
    patch at admission)."""
    members: list[list[ChunkKV]] = [[] for _ in pieces]
    for order in _other_legend_orders(seq):
        inputs = backend.reference_inputs([seq.chunks[i] for i in order])
        with torch.no_grad():
            truth = output_cache(backend.model(**inputs, use_cache=True))
        slot, start = backend.anchor.num_tokens, backend.anchor.advance
        for j, i in enumerate(order):
            chunk = seq.chunks[i]
            if set(order[:j]) == set(range(i)):
                positions = chunk.positions_at(start)
                members[i].append(read_chunk(truth, backend.layout, slot, slot + chunk.num_tokens, positions))
            slot, start = slot + chunk.num_tokens, start + chunk.advance
    return [found or [conditioned] for found, (_, conditioned, _) in zip(members, pieces, strict=True)]


HELD_OUT_ORDERS = 2
"""Orderings of the legend an orbit patch averages over (the item's own is never one of them)."""


def _other_legend_orders(seq: ItemSequence) -> list[list[int]]:
    """Chunk indices with the legend frames in other orders than the item's, drawn from the item."""
    legend = list(range(len(seq.item.legend)))
    others = [list(p) for p in itertools.permutations(legend) if list(p) != legend]
    random.Random(repr(seq.item)).shuffle(others)
    rest = list(range(len(legend), len(seq.chunks)))
    return [order + rest for order in others[:HELD_OUT_ORDERS]]


def _order_change(
    canonical: ChunkKV, own: ChunkKV, others: Sequence[ChunkKV], layout: KVLayout
) -> list[float]:
    """Per other ordering: ``‖Δπ − Δ‖ / ‖Δ‖``, position-free, keys and values of every layer."""
    free = to_position_free(own, layout)
    size = sum(float((t - c).float().pow(2).sum()) for t, c in _slots(free, canonical)) ** 0.5
    changes = []
    for other in others:
        moved = to_position_free(other, layout)
        change = sum(float((m - t).float().pow(2).sum()) for m, t in _slots(moved, free)) ** 0.5
        changes.append(change / max(size, 1e-30))
    return changes


def _slots(a: ChunkKV, b: ChunkKV) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    return ((a.keys, b.keys), (a.values, b.values))


def _deficit(pages: Sequence[PageKV], layout: KVLayout) -> Deficit:
    """The pages' deficit against their canonicals, per layer (see `Deficit`)."""
    out = Deficit(chunks=len(pages))
    for canonical, conditioned, _ in pages:
        free = to_position_free(conditioned, layout)
        layers = canonical.keys.shape[0]
        if not out.energy:
            out.energy, out.relative = [0.0] * layers, [0.0] * layers
        for layer in range(layers):
            delta_norm2, truth_norm2 = 0.0, 0.0
            for ours, truth in ((canonical.keys, free.keys), (canonical.values, free.values)):
                delta = (truth[layer] - ours[layer]).float().transpose(0, 1).reshape(truth.shape[2], -1)
                delta_norm2 += float(delta.pow(2).sum())
                truth_norm2 += float(truth[layer].float().pow(2).sum())
                singular = torch.linalg.svdvals(delta).pow(2)
                share = singular.cumsum(0) / singular.sum().clamp_min(1e-30)
                out.rank90.append(int((share < 0.9).sum()) + 1)
            out.energy[layer] += delta_norm2
            out.relative[layer] += (delta_norm2 / max(truth_norm2, 1e-30)) ** 0.5
    return out


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
            tally.outcomes.append((top == answer_token, next_token_kl(reference, logits)))
