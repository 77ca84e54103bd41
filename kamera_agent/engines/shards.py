"""Store entries split the way an engine splits KV over its ranks: heads over TP, layers over PP.

Why: a tensor-parallel rank holds ``kv_heads / tp`` heads of every layer and a pipeline stage
holds only its layers, so one rank's view of a chunk is a *piece* of the chunk's KV. Filed under
the chunk's entry, pieces of different ranks would overwrite each other (and a stage would pass
its first layer off as the model's layer 0). Each rank files its piece as a **shard** entry,
``entry`` plus the head and layer range it covers out of the model's; a reader assembles the
range it holds from whatever pieces cover it: the whole entry (a window's, or an engine run on
one rank), shards of its own grid, or shards of another grid (a TP=2 writer serving a TP=1
reader). The grids a reader tries are its own, the whole, and the even splits of the heads
(every TP degree that divides them) and of the layers (vLLM's default partition into 2 to 4
stages); pieces of any other grid are not found (a miss: the engine computes the tokens).

    writer rank (heads a:b, layers c:d) ──put──► entry#kv:h{a}-{b}/{H}:l{c}-{d}/{L}
    reader rank (heads a':b', layers c':d') ◄──get── whole entry | covering shards, sliced and joined

A single-rank engine (TP=1, PP=1) reads and writes whole entries, as a window does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from kamera_agent.errors import KameraError
from kamera_agent.operator.layout import ChunkKV, KVLayout
from kamera_agent.store import EntryKey

__all__ = ["EntryStore", "Grid", "ShardError", "ShardedStore", "even_stages", "shard_entry"]

Range = tuple[int, int]


class ShardError(KameraError):
    """An engine's parallel split that kamera's entries cannot follow (heads that do not divide
    over the TP ranks, stages that do not tile the layers)."""


class EntryStore(Protocol):
    """What `PrefixSynthesis` needs of a store: a `ChunkStore`, or one rank's `ShardedStore`."""

    def contains(self, key: EntryKey) -> bool: ...

    def get(self, key: EntryKey) -> object: ...

    def put(self, key: EntryKey, value: ChunkKV) -> object: ...


def even_stages(layers: int, stages: int) -> tuple[Range, ...]:
    """vLLM's default split of ``layers`` into ``stages`` (``vllm.distributed.utils.get_pp_indices``
    without ``VLLM_PP_LAYER_PARTITION``): even, the remainder to the stages before the last."""
    sizes = [layers // stages] * stages
    for i in range(2, layers % stages + 2):
        sizes[-i] += 1
    bounds = [sum(sizes[:i]) for i in range(stages + 1)]
    return tuple(itertools.pairwise(bounds))


@dataclass(frozen=True)
class Grid:
    """How an engine splits a chunk's KV: ``heads`` KV heads over ``tp`` ranks (vLLM's split: even
    ranges, a head replicated over ``tp / heads`` ranks where ranks outnumber heads; MLA's one
    latent on every rank) and ``layers`` over ``stages`` (layer ranges, in order)."""

    heads: int
    layers: int
    tp: int = 1
    stages: tuple[Range, ...] = ()

    def __post_init__(self) -> None:
        if not self.stages:
            object.__setattr__(self, "stages", ((0, self.layers),))
        if (
            self.tp < 1
            or (self.tp <= self.heads and self.heads % self.tp)
            or (self.tp > self.heads and self.tp % self.heads)
        ):
            raise ShardError(
                f"{self.heads} KV heads cannot be split over {self.tp} tensor-parallel ranks the way "
                "vLLM splits them (one must divide the other)"
            )
        ends = [0, *(b for _, b in self.stages)]
        if [a for a, _ in self.stages] != ends[:-1] or ends[-1] != self.layers:
            raise ShardError(f"pipeline stages {self.stages} do not tile the model's {self.layers} layers")

    @classmethod
    def of(cls, layout: KVLayout, tp: int = 1, stages: Sequence[Range] = ()) -> Grid:
        """The grid of a model with ``layout`` (heads: its keys slot's; MLA: the one latent)."""
        return cls(layout.keys_shape[0], layout.num_layers, tp, tuple(stages))

    @property
    def single(self) -> bool:
        """One piece holds everything: entries are whole, as a window's."""
        return len(self.stages) == 1 and self.head_range(0) == (0, self.heads)

    def head_range(self, tp_rank: int) -> Range:
        """The KV heads TP rank ``tp_rank`` holds."""
        if self.tp <= self.heads:
            per = self.heads // self.tp
            return tp_rank * per, (tp_rank + 1) * per
        head = tp_rank // (self.tp // self.heads)
        return head, head + 1

    def writes(self, tp_rank: int) -> bool:
        """Whether ``tp_rank`` files its piece: the first of the ranks holding the same heads."""
        return self.tp <= self.heads or tp_rank % (self.tp // self.heads) == 0

    def pieces(self) -> list[tuple[Range, Range]]:
        """Every distinct (heads, layers) piece a rank of this grid holds."""
        heads = sorted({self.head_range(r) for r in range(self.tp)})
        return [(h, layers) for layers in self.stages for h in heads]


def shard_entry(entry: EntryKey, heads: Range, layers: Range, grid: tuple[int, int]) -> EntryKey:
    """The entry of ``entry``'s piece over ``heads`` and ``layers`` of a model with ``grid`` =
    (heads, layers)."""
    tag = f"#kv:h{heads[0]}-{heads[1]}/{grid[0]}:l{layers[0]}-{layers[1]}/{grid[1]}"
    return EntryKey(entry.kind, entry.key, entry.variant + tag)


class ShardedStore:
    """A store as one rank of ``grid`` sees it: pieces in, the rank's piece out.

    Args:
        store: the shared store (a `ChunkStore`).
        grid: the engine's split.
        tp_rank, stage: this rank's place in it; ``None`` for the scheduler side, which only
            asks whether every rank can read an entry (`contains`).
    """

    def __init__(self, store: EntryStore, grid: Grid, tp_rank: int | None = None, stage: int | None = None):
        self.store, self.grid, self.tp_rank, self.stage = store, grid, tp_rank, stage

    @property
    def heads(self) -> Range:
        return self.grid.head_range(self.tp_rank or 0)

    @property
    def layers(self) -> Range:
        return self.grid.stages[self.stage or 0]

    def contains(self, key: EntryKey) -> bool:
        """Whether every rank of the grid (the scheduler side) or this rank can assemble its piece."""
        if self.tp_rank is not None:
            return self._cover(key, self.heads, self.layers) is not None
        return all(self._cover(key, h, layers) is not None for h, layers in self.grid.pieces())

    def get(self, key: EntryKey) -> ChunkKV | None:
        """This rank's piece of ``key`` (``[its layers, its heads, n, dim]``), or ``None``."""
        heads, layers = self.heads, self.layers
        cover = self._cover(key, heads, layers)
        if cover is None:
            return None
        parts: list[tuple[ChunkKV, Range, Range]] = []
        for entry, h, lay in cover:
            kv = self.store.get(entry)
            if not isinstance(kv, ChunkKV) or tuple(kv.keys.shape[:2]) != (lay[1] - lay[0], h[1] - h[0]):
                return None  # gone since `contains`, or not a piece of this model
            if parts and kv.num_tokens != parts[0][0].num_tokens:
                return None
            parts.append((kv, h, lay))
        return _join(parts, heads, layers, key.key)

    def put(self, key: EntryKey, value: ChunkKV) -> None:
        """File this rank's piece ``value`` (whole where the grid is single; nothing where another
        rank holding the same heads files it)."""
        if self.grid.single:
            self.store.put(key, value)
        elif self.grid.writes(self.tp_rank or 0):
            size = (self.grid.heads, self.grid.layers)
            self.store.put(shard_entry(key, self.heads, self.layers, size), value)

    # -- assembly ----------------------------------------------------------------------------
    def _cover(
        self, key: EntryKey, heads: Range, layers: Range
    ) -> list[tuple[EntryKey, Range, Range]] | None:
        """The entries that together hold ``heads`` x ``layers`` of ``key``, first grid found."""
        size = (self.grid.heads, self.grid.layers)
        for head_bounds, layer_bounds in self._grids():
            hs, ls = _overlapping(head_bounds, heads), _overlapping(layer_bounds, layers)
            if hs is None or ls is None:
                continue
            cover = []
            for h in hs:
                for lay in ls:
                    whole = h == (0, size[0]) and lay == (0, size[1])
                    cover.append((key if whole else shard_entry(key, h, lay, size), h, lay))
            if all(self.store.contains(entry) for entry, _, _ in cover):
                return cover
        return None

    def _grids(self) -> Iterator[tuple[tuple[Range, ...], tuple[Range, ...]]]:
        heads, layers = self.grid.heads, self.grid.layers
        own = (tuple(sorted({self.grid.head_range(r) for r in range(self.grid.tp)})), self.grid.stages)
        whole = (((0, heads),), ((0, layers),))
        seen = {own, whole}
        yield own
        yield whole
        head_grids = [
            tuple((i * heads // t, (i + 1) * heads // t) for i in range(t)) for t in _divisors(heads)
        ]
        layer_grids = [even_stages(layers, s) for s in range(1, min(layers, 4) + 1)]
        for h in head_grids:
            for lay in layer_grids:
                if (h, lay) not in seen:
                    seen.add((h, lay))
                    yield h, lay


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _overlapping(bounds: Sequence[Range], want: Range) -> list[Range] | None:
    """The ranges of ``bounds`` (in order, tiling) that cover ``want``; ``None`` if they do not."""
    out = [b for b in bounds if b[0] < want[1] and want[0] < b[1]]
    return out if out and out[0][0] <= want[0] and out[-1][1] >= want[1] else None


def _join(parts: list[tuple[ChunkKV, Range, Range]], heads: Range, layers: Range, chunk_key: str) -> ChunkKV:
    first, first_heads, first_layers = parts[0]
    if len(parts) == 1 and (first_heads, first_layers) == (heads, layers):
        return replace(first, chunk_key=chunk_key)  # exactly the range read: no copy (every TP=1 load)
    n = first.num_tokens
    shape_k = (layers[1] - layers[0], heads[1] - heads[0], n, first.keys.shape[3])
    shape_v = (layers[1] - layers[0], heads[1] - heads[0], n, first.values.shape[3])
    keys, values = (
        torch.empty(shape_k, dtype=first.keys.dtype),
        torch.empty(shape_v, dtype=first.values.dtype),
    )
    for kv, h, lay in parts:
        lo, hi = max(lay[0], layers[0]), min(lay[1], layers[1])
        a, b = max(h[0], heads[0]), min(h[1], heads[1])
        src = (slice(lo - lay[0], hi - lay[0]), slice(a - h[0], b - h[0]))
        dst = (slice(lo - layers[0], hi - layers[0]), slice(a - heads[0], b - heads[0]))
        keys[dst], values[dst] = kv.keys[src], kv.values[src]
    return replace(first, keys=keys, values=values, chunk_key=chunk_key)
