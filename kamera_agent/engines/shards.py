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

A miss must stay cheap: the scheduler side asks on its step for every chunk of every request,
and most chunks are new. A reader given a `Splits` memory (an engine's connector) tries only the
grids it knows hold pieces (its own, the whole, and any found since): one lookup per known grid,
one in all for a single-rank engine. The other even splits are scanned on the first miss and
then on every ``scan_every``-th, and a grid found so is known from then on (a TP=1 server
reading a TP=2 server's captures learns their split from its first hit). Without one (`Splits`
``None``) every miss scans every grid. The store is asked first; an entry the engine's own
workers report filed (`Splits.filed`) that it does not show yet counts as present for
`FILED_FOR` seconds: the scheduler side learns of its workers' captures before the store it
reads does (a shared tier's writes are behind, and it remembers a miss for a second). Such an
offer may still fail (the entry evicted meanwhile): the load then fails once, the request is
computed and the entry is not offered again until filed anew (`kamera_agent.engines.offers`).

    writer rank (heads a:b, layers c:d) ──put──► entry#kv:h{a}-{b}/{H}:l{c}-{d}/{L}
    reader rank (heads a':b', layers c':d') ◄──get── whole entry | covering shards, sliced and joined

A single-rank engine (TP=1, PP=1) reads and writes whole entries, as a window does.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from kamera_agent.errors import KameraError
from kamera_agent.operator.layout import ChunkKV, KVLayout
from kamera_agent.store import EntryKey
from kamera_agent.store.expiring import Expiring

__all__ = [
    "FILED_FOR",
    "EntryStore",
    "Grid",
    "ShardError",
    "ShardedStore",
    "Splits",
    "even_stages",
    "shard_entry",
    "unsharded",
]

Range = tuple[int, int]
Split = tuple[tuple[Range, ...], tuple[Range, ...]]
"""A grid as the ranges it cuts: (head ranges, layer ranges), each tiling in order."""
FILED_FOR = 5.0
"""Seconds an entry the engine's workers report filed counts as present where the store does not
show it yet: long enough to outlast a shared tier's write-behind and its remembered miss (a
second); what the store says decides after that."""
_TAG = "#kv:"


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


@dataclass
class Splits:
    """What one engine side remembers across lookups: the grids found holding pieces and the
    entries its workers reported filed. Thread-safe (a connector's worker writes from a thread).

    Attributes:
        scan_every: a miss in every known grid scans the other even splits on the first such miss
            and every ``scan_every``-th after it.
        filed_for: seconds a reported entry counts as present where the store does not show it.
    """

    scan_every: int = 64
    filed_for: float = FILED_FOR
    known: list[Split] = field(default_factory=list, init=False)
    """Grids found holding pieces, in the order they are tried."""
    misses: int = field(default=0, init=False)
    """Lookups that found nothing in the known grids."""
    scans: int = field(default=0, init=False)
    """Of those, the ones that tried every other grid."""
    _filed: Expiring[EntryKey] = field(init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self._filed = Expiring(self.filed_for)

    def learn(self, split: Split) -> None:
        with self._lock:
            if split not in self.known:
                self.known.append(split)

    def scan_due(self) -> bool:
        """Count a miss in the known grids; whether this one scans the rest."""
        with self._lock:
            due = self.misses % max(self.scan_every, 1) == 0
            self.misses += 1
            self.scans += due
            return due

    def filed(self, entries: Iterable[EntryKey]) -> None:
        """The workers filed ``entries`` (as they name them: shard entries or whole ones)."""
        self._filed.add_all(entries)

    def was_filed(self, entry: EntryKey) -> bool:
        return entry in self._filed


def shard_entry(entry: EntryKey, heads: Range, layers: Range, grid: tuple[int, int]) -> EntryKey:
    """The entry of ``entry``'s piece over ``heads`` and ``layers`` of a model with ``grid`` =
    (heads, layers)."""
    tag = f"{_TAG}h{heads[0]}-{heads[1]}/{grid[0]}:l{layers[0]}-{layers[1]}/{grid[1]}"
    return EntryKey(entry.kind, entry.key, entry.variant + tag)


def unsharded(entry: EntryKey) -> EntryKey:
    """The chunk's entry a piece (`shard_entry`) belongs to; a whole entry itself."""
    variant, tag, _ = entry.variant.partition(_TAG)
    return EntryKey(entry.kind, entry.key, variant) if tag else entry


class ShardedStore:
    """A store as one rank of ``grid`` sees it: pieces in, the rank's piece out.

    Args:
        store: the shared store (a `ChunkStore`).
        grid: the engine's split.
        tp_rank, stage: this rank's place in it; ``None`` for the scheduler side, which only
            asks whether every rank can read an entry (`contains`).
        splits: what this side remembers across lookups (known grids, entries reported filed);
            ``None``: nothing, every miss tries every grid.
    """

    def __init__(
        self,
        store: EntryStore,
        grid: Grid,
        tp_rank: int | None = None,
        stage: int | None = None,
        splits: Splits | None = None,
    ):
        self.store, self.grid, self.tp_rank, self.stage = store, grid, tp_rank, stage
        self.splits = splits
        if splits is not None:
            splits.learn(self._own())
            splits.learn(self._whole())

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

    def put(self, key: EntryKey, value: ChunkKV) -> EntryKey | None:
        """File this rank's piece ``value`` (whole where the grid is single; nothing where another
        rank holding the same heads files it). Returns the entry filed, or ``None``."""
        filed = self.filed_as(key)
        if filed is not None:
            self.store.put(filed, value)
        return filed

    def filed_as(self, key: EntryKey) -> EntryKey | None:
        """The entry this rank files its piece of ``key`` under (``None``: another rank files it)."""
        if self.grid.single:
            return key
        if self.grid.writes(self.tp_rank or 0):
            return shard_entry(key, self.heads, self.layers, (self.grid.heads, self.grid.layers))
        return None

    # -- assembly ----------------------------------------------------------------------------
    def _cover(
        self, key: EntryKey, heads: Range, layers: Range
    ) -> list[tuple[EntryKey, Range, Range]] | None:
        """The entries that together hold ``heads`` x ``layers`` of ``key``, first grid found:
        the known grids first (every grid without a `Splits` memory), the rest when a scan is due."""
        known = self.splits.known if self.splits is not None else [self._own(), self._whole()]
        for split in list(known):
            cover = self._cover_in(key, split, heads, layers)
            if cover is not None:
                return cover
        if self.splits is not None and not self.splits.scan_due():
            return None
        for split in self._grids():
            if split in known:
                continue
            cover = self._cover_in(key, split, heads, layers)
            if cover is not None:
                if self.splits is not None:
                    self.splits.learn(split)
                return cover
        return None

    def _cover_in(
        self, key: EntryKey, split: Split, heads: Range, layers: Range
    ) -> list[tuple[EntryKey, Range, Range]] | None:
        size = (self.grid.heads, self.grid.layers)
        hs, ls = _overlapping(split[0], heads), _overlapping(split[1], layers)
        if hs is None or ls is None:
            return None
        cover = []
        for h in hs:
            for lay in ls:
                whole = h == (0, size[0]) and lay == (0, size[1])
                cover.append((key if whole else shard_entry(key, h, lay, size), h, lay))
        return cover if all(self._has(entry) for entry, _, _ in cover) else None

    def _has(self, entry: EntryKey) -> bool:
        """The store holds ``entry``, or this side's workers filed it a moment ago."""
        return self.store.contains(entry) or (self.splits is not None and self.splits.was_filed(entry))

    def _own(self) -> Split:
        return tuple(sorted({self.grid.head_range(r) for r in range(self.grid.tp)})), self.grid.stages

    def _whole(self) -> Split:
        return ((0, self.grid.heads),), ((0, self.grid.layers),)

    def _grids(self) -> Iterator[Split]:
        heads, layers = self.grid.heads, self.grid.layers
        seen = {self._own(), self._whole()}
        yield self._own()
        yield self._whole()
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
