"""Entries split as engines split KV: every rank files its piece, any grid's rank reads its own.

The checks compare against the whole chunk KV the pieces were cut from: a reader's piece must be
exactly that tensor's heads and layers, whichever grid wrote it (TP=2 writing for TP=1, PP=2 x
TP=2 writing for TP=4, a window's whole entry read by a TP rank), and a piece missing anywhere
is a miss on every rank that needs it, never a wrong or partial answer.
"""

from __future__ import annotations

import pytest
import torch

from kamera_agent.engines.shards import Grid, ShardedStore, ShardError, even_stages, shard_entry
from kamera_agent.operator.layout import ChunkKV, KVLayout
from kamera_agent.operator.rope import RotarySpec
from kamera_agent.store import ChunkStore, EntryKey

LAYERS, HEADS, HEAD, TOKENS = 6, 4, 8, 5
FINGERPRINT = "f" * 64
ENTRY = EntryKey.canonical("c" * 64)


def _layout(heads: int = HEADS, kind: str = "gqa") -> KVLayout:
    rope = RotarySpec(inv_freq=1.0 / (10000 ** (torch.arange(0, HEAD, 2).float() / HEAD)), pairing="half")
    return KVLayout(kind, LAYERS, (heads, HEAD), (heads, HEAD), "keys", rope)  # type: ignore[arg-type]


def _whole(heads: int = HEADS) -> ChunkKV:
    torch.manual_seed(0)
    shape = (LAYERS, heads, TOKENS, HEAD)
    return ChunkKV(torch.randn(shape), torch.randn(shape), None, ENTRY.key)


def _store() -> ChunkStore:
    return ChunkStore(fingerprint=FINGERPRINT, memory_limit=1 << 24)


def _piece(kv: ChunkKV, heads: tuple[int, int], layers: tuple[int, int]) -> ChunkKV:
    cut = (slice(*layers), slice(*heads))
    return ChunkKV(kv.keys[cut].clone(), kv.values[cut].clone(), None, kv.chunk_key)


def _write_all(store: ChunkStore, grid: Grid, kv: ChunkKV, but: tuple[int, int] | None = None) -> None:
    """Every rank of ``grid`` (``but`` the (rank, stage) given) files the piece it holds."""
    for stage, layers in enumerate(grid.stages):
        for rank in range(grid.tp):
            if (rank, stage) != but:
                piece = _piece(kv, grid.head_range(rank), layers)
                ShardedStore(store, grid, rank, stage).put(ENTRY, piece)


def _assert_reads(store: ChunkStore, grid: Grid, kv: ChunkKV) -> None:
    for stage, layers in enumerate(grid.stages):
        for rank in range(grid.tp):
            got = ShardedStore(store, grid, rank, stage).get(ENTRY)
            assert got is not None, (rank, stage)
            want = _piece(kv, grid.head_range(rank), layers)
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values), (rank, stage)


def test_pieces_written_under_one_grid_are_read_whole_and_under_others() -> None:
    store, kv = _store(), _whole()
    writer = Grid.of(_layout(), tp=2, stages=even_stages(LAYERS, 2))
    _write_all(store, writer, kv)
    assert not store.contains(ENTRY)  # no rank passed its piece off as the whole entry
    assert ShardedStore(store, writer).contains(ENTRY)  # the scheduler side: every rank can read
    for reader in (
        writer,
        Grid.of(_layout()),  # one rank reads every piece joined
        Grid.of(_layout(), tp=4),  # finer heads: slices of the pieces
        Grid.of(_layout(), tp=1, stages=even_stages(LAYERS, 3)),  # other stage cuts
    ):
        _assert_reads(store, reader, kv)


def test_a_whole_entry_serves_every_rank_and_a_single_grid_writes_whole_entries() -> None:
    store, kv = _store(), _whole()
    ShardedStore(store, Grid.of(_layout()), 0, 0).put(ENTRY, kv)  # a window's, or TP=1 PP=1
    assert store.contains(ENTRY)
    _assert_reads(store, Grid.of(_layout(), tp=2, stages=even_stages(LAYERS, 2)), kv)


def test_a_missing_piece_is_a_miss_for_the_ranks_that_need_it() -> None:
    store, kv = _store(), _whole()
    writer = Grid.of(_layout(), tp=2, stages=even_stages(LAYERS, 2))
    _write_all(store, writer, kv, but=(1, 1))  # one rank's capture failed
    assert not store.contains(shard_entry(ENTRY, writer.head_range(1), writer.stages[1], (HEADS, LAYERS)))
    assert not ShardedStore(store, writer).contains(ENTRY)  # the scheduler side offers nothing
    assert ShardedStore(store, writer, 1, 1).get(ENTRY) is None
    assert ShardedStore(store, writer, 0, 1).get(ENTRY) is not None  # its own piece is there
    assert ShardedStore(store, Grid.of(_layout()), 0, 0).get(ENTRY) is None  # never a partial join


def test_pieces_of_different_lengths_are_never_joined() -> None:
    store, kv = _store(), _whole()
    writer = Grid.of(_layout(), tp=2)
    _write_all(store, writer, kv)
    short = _piece(kv, writer.head_range(1), (0, LAYERS))
    short = ChunkKV(short.keys[:, :, :2], short.values[:, :, :2], None, kv.chunk_key)
    ShardedStore(store, writer, 1, 0).put(ENTRY, short)  # another writer's shorter piece
    assert ShardedStore(store, Grid.of(_layout()), 0, 0).get(ENTRY) is None


def test_replicated_heads_are_filed_once_and_read_by_every_replica() -> None:
    """TP beyond the KV heads: vLLM replicates each head over ``tp / heads`` ranks."""
    store, kv = _store(), _whole(heads=2)
    grid = Grid.of(_layout(heads=2), tp=4)
    assert [grid.head_range(r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [grid.writes(r) for r in range(4)] == [True, False, True, False]
    _write_all(store, grid, kv)
    assert len(store.keys()) == 2
    _assert_reads(store, grid, kv)


def test_splits_an_engine_cannot_make_are_refused_by_name() -> None:
    with pytest.raises(ShardError, match="tensor-parallel"):
        Grid.of(_layout(), tp=3)
    with pytest.raises(ShardError, match="tile"):
        Grid.of(_layout(), stages=((0, 2), (3, LAYERS)))


def test_even_stages_give_the_remainder_to_the_stages_before_the_last() -> None:
    """vLLM's ``get_pp_indices`` without a partition (compared with vLLM itself in its env)."""
    assert even_stages(6, 2) == ((0, 3), (3, 6))
    assert even_stages(7, 3) == ((0, 2), (2, 5), (5, 7))
    assert even_stages(10, 4) == ((0, 2), (2, 5), (5, 8), (8, 10))
