"""Placing a window's chunks and building the KV their states name: what running a plan and
answering over the window both stand on.

Why apart from running plans (`kamera_agent.window.executor`): a chunk's KV at its place, a
state's KV rebuilt from the store or from its context, the engine cache of the window as it is
(cut back and extended where the engine retains caches) are read by every step, every answer and
every probe; the executor's own job is to turn a plan's steps into new states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.config import WindowConfig
from kamera_agent.core import Patch
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.core.kv_core import KVCore, Txn
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.window.state import Assembled, ChunkRef, WindowRecord

__all__ = ["Placement", "Stretch"]

Stretch = tuple[tuple[object, ...], int]
"""What one stretch of an assembled cache holds (the anchor, or a chunk at its start in its
state) and how many cache slots it takes."""


class Placement:
    """One window state's chunks placed and its states' KV built, inside one transaction (memoised
    for the op: each state is built and each chunk placed once)."""

    def __init__(self, state: WindowRecord, core: KVCore, txn: Txn, config: WindowConfig) -> None:
        self.state, self.core, self.txn, self.config = state, core, txn, config
        self.layout = core.backend.layout
        self._starts: dict[ChunkRef, int] = {}
        self._slots: dict[ChunkRef, int] = {}
        self._parts: dict[str, tuple[ChunkKV, Patch | None]] = {}
        self._full: dict[str, ChunkKV] = {}
        self._by_key: dict[str, Chunk] | None = None
        self._moved: frozenset[ChunkRef] = frozenset()
        self._placed: dict[tuple[ChunkRef, int, str], ChunkKV] = {}
        self._held: dict[ChunkRef, tuple[ChunkState, Patch | None, ChunkKV | None]] = {}
        self._order_changed()

    # -- KV of chunks and states -------------------------------------------------------------------
    def canonical(self, ref: ChunkRef) -> ChunkKV:
        """The chunk's canonical (a prefill when the store has none: a re-form if it had one)."""
        entry = self.state.entries[ref]
        meter = self.txn.meter
        fresh = entry.chunk.key not in meter.prefilled
        canonical = self.core.canonical(entry.chunk, self.txn)
        if fresh and entry.chunk.key in meter.prefilled:
            meter.add(reforms=int(entry.canonical_formed))
        entry.canonical_formed = True
        return canonical

    def position_free_parts(self, state: ChunkState) -> tuple[ChunkKV, Patch | None]:
        """What a state is made of, position-free: its full KV, or its canonical and patch; from
        the store, or rebuilt (original contexts, entries the store has dropped)."""
        if state.digest in self._parts:
            return self._parts[state.digest]
        holder = self._holder(state)
        if holder is not None:  # a chunk in the window has it (its patch or KV may be held only there)
            self._parts[state.digest] = self._made_of(holder)
            return self._parts[state.digest]
        chunk = self._chunk_for(state.chunk_key)
        patch: Patch | None = None
        reference = self._full_kv(state, chunk) if state.is_full else self.core.canonical(chunk, self.txn)
        if state.kind == "orbit" and not state.is_full:
            patch = self.core.stored_patch(state, state.address, self.txn)
        elif state.kind == "patched" and not state.is_full:
            patch = self.core.stored_patch(state, state.digest, self.txn)
            if patch is None:
                conditioned = self._conditioned_over(chunk, state.context)
                patch = self.core.store_patch(reference, state, conditioned, self.txn)
                self.txn.meter.add(patches_formed=1)
        self._parts[state.digest] = (reference, patch)
        return reference, patch

    def _full_kv(self, state: ChunkState, chunk: Chunk, held: bool = False) -> ChunkKV:
        """A full-rank state's KV: from this op, the store, or one conditioned forward (stored).

        ``held``: a chunk in the window holds this state, so its KV was stored once and missing
        now means a budget dropped it (a re-form)."""
        if state.digest in self._full:
            return self._full[state.digest]
        kv = self.core.stored_full(state, self.txn)
        if kv is None and state.kind == "recomputed":
            kv = self.core.store_full(state, self._recomputed_over(chunk, state), self.txn)
            self.txn.meter.add(reforms=int(held))
        elif kv is None:
            kv = self.core.store_full(state, self._conditioned_over(chunk, state.context), self.txn)
            self.txn.meter.add(reforms=int(held))
        self._full[state.digest] = kv
        return kv

    def placed_kv(self, ref: ChunkRef) -> ChunkKV:
        """The chunk's KV at its place in the window."""
        return self._places([ref])[0]

    def _places(self, refs: Sequence[ChunkRef]) -> list[ChunkKV]:
        """In-window chunks at their places, those not yet placed in this op rotated together."""
        keys = [(ref, self._starts[ref], self.state.entries[ref].state.digest) for ref in refs]
        missing = [key for key in dict.fromkeys(keys) if key not in self._placed]
        entries = self.state.entries
        jobs = [(*self._made_of(ref), entries[ref].chunk.positions_at(start)) for ref, start, _ in missing]
        self._placed.update(zip(missing, self.core.place_many(jobs), strict=True))
        return [self._placed[key] for key in keys]

    def placements(self, end: int | None = None) -> list[ChunkKV]:
        """The anchor and every in-window chunk (the first ``end``), placed: what a decode attends to."""
        return [self.core.anchor_kv(self.txn.meter), *self._places(self.state.order[:end])]

    def window_cache(self, count: int | None = None) -> Any:
        """The engine cache holding the window as it is now (its anchor and first ``count``
        chunks: all by default).

        Why incremental: an agent pushes, asks, pushes, asks. Where the engine can crop and
        extend a cache, the one the last answer used is cut back to the longest run of leading
        chunks that did not change (same place, same state) and only the rest is placed and
        appended: a push then costs its own tokens, not a copy of the window. A chunk that moved
        or changed state, and everything after it, is placed again.
        """
        cache, stretches = self._cache_through(len(self.state.order) if count is None else count)
        self.state.assembled = (
            Assembled(cache, tuple(stretches)) if self.core.backend.supports_extend else None
        )
        return cache

    def _cache_through(self, count: int, tail: int = 0) -> tuple[Any, list[Stretch]]:
        """An engine cache holding the anchor and the first ``count`` in-window chunks as they
        are now, built on the retained one where the engine can (see `window_cache`), and its
        stretches; ``tail``: the first tokens of the retained cache's tail stay after them
        (every stretch it holds is the same: `kamera_agent.window.tail`)."""
        backend, state = self.core.backend, self.state
        stretches: list[Stretch] = [(("anchor",), self.core.anchor.num_tokens)]
        for ref in state.order[:count]:
            entry = state.entries[ref]
            stretches.append(((ref, self._starts[ref], entry.state.digest), entry.chunk.num_tokens))
        memo, same = state.assembled, 0
        if backend.supports_extend and memo is not None:
            for mine, theirs in zip(stretches, memo.stretches, strict=False):
                if mine != theirs:
                    break
                same += 1
        if same == 0:
            cache = backend.assemble(
                [self.core.anchor_kv(self.txn.meter), *self._places(state.order[:count])]
            )
        else:
            assert memo is not None
            assert not tail or same == len(stretches) == len(memo.stretches), "a tail reused after a change"
            cache = backend.crop(memo.cache, sum(slots for _, slots in stretches[:same]) + tail)
            cache = backend.assemble(self._places(state.order[same - 1 : count]), onto=cache)
        self.txn.meter.add(tokens_placed=sum(slots for _, slots in stretches[same:]))
        return cache, stretches

    def _made_of(self, ref: ChunkRef) -> tuple[ChunkKV, Patch | None]:
        """What an in-window chunk's KV is made of now: its full KV, or its canonical and patch."""
        entry = self.state.entries[ref]
        if entry.full is not None:
            return entry.full, None
        if entry.state.is_full:
            return self._full_kv(entry.state, entry.chunk, held=True), None
        return self.canonical(ref), entry.patch

    def end(self, count: int | None = None) -> int:
        """The position after the window's last chunk (its ``count``-th): where a query starts."""
        order = self.state.order[:count]
        return self.core.anchor.advance + sum(self.state.entries[r].chunk.advance for r in order)

    # -- a state's KV formed over its context ------------------------------------------------------
    def _conditioned_over(self, chunk: Chunk, context: Context) -> ChunkKV:
        placed, start = self._placed_context(context)
        return self.core.condition([chunk], placed, start, self.txn).kv[0]

    def _placed_context(self, context: Context) -> tuple[list[ChunkKV], int]:
        """The anchor and ``context``'s states placed back to back behind it, and where a chunk
        after them starts."""
        jobs, start = [], self.core.anchor.advance
        for state in context.states():
            source = self._chunk_for(state.chunk_key)
            jobs.append((*self.position_free_parts(state), source.positions_at(start)))
            start += source.advance
        return [self.core.anchor_kv(self.txn.meter), *self.core.place_many(jobs)], start

    def _recomputed_over(self, chunk: Chunk, state: ChunkState) -> ChunkKV:
        """A recomputed state's KV made again as it was first made: its source placed behind its
        context, its most deviating (or first) tokens recomputed over it (`KVCore.recompute`)."""
        assert state.source is not None
        placed, start = self._placed_context(state.context)
        reference, patch = self.position_free_parts(state.source)
        kv = self.core.place(reference, patch, chunk.positions_at(start))
        return self.core.recompute(chunk, kv, placed, start, state.share, self.txn, head=state.head).kv

    # -- helpers -------------------------------------------------------------------------------------
    def _order_changed(self) -> None:
        self._starts, position = {}, self.core.anchor.advance
        self._slots = {ref: i for i, ref in enumerate(self.state.order)}
        for ref in self.state.order:
            self._starts[ref] = position
            position += self.state.entries[ref].chunk.advance

    def _reused(self, ref: ChunkRef) -> None:
        chunk = self.state.entries[ref].chunk
        self.txn.meter.reuse(ref, chunk.key, chunk.num_tokens)

    def _holder(self, state: ChunkState) -> ChunkRef | None:
        """An in-window chunk in exactly this state, if any."""
        for ref in self.state.order:
            entry = self.state.entries[ref]
            if entry.state.digest == state.digest and not entry.pending:
                return ref
        return None

    def _chunk_for(self, chunk_key: str) -> Chunk:
        if self._by_key is None:
            self._by_key = {entry.chunk.key: entry.chunk for entry in self.state.entries.values()}
        return self._by_key[chunk_key]
