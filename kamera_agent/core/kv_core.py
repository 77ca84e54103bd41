"""The engine-neutral core: every chunk's KV from the store or one backend primitive, with its cost.

Why one place: what is not engine-specific must not be written again per engine. Here, once:

- store lookups: canonicals, vision outputs (by the pixels' key) and patches, through the
  operation's `StagedStore`, so a failed op stores nothing;
- origin checks: a chunk prepared for another model or processing setting is refused;
- the position-free form: a prefilled canonical is un-rotated before it is stored;
- every KV formation: what a conditioned forward computed becomes a state's stored KV (a
  full-rank state stores the KV itself, a rank-m one a patch against the canonical), folded into
  its orbit where orbits are on;
- device moves: entries read back from a disk tier live on the CPU until used here;
- costs: each primitive's `Spent` lands in the operation's `CostMeter`;
- the context limit, checked before a decode.

A backend below only prefills, runs its vision tower, assembles and decodes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import torch

from kamera_agent.backends.base import Backend, DecodeConfig, Prefilled, VisionFeatures
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.core.costs import CostMeter
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.core.orbits import fold_full_orbit, fold_orbit
from kamera_agent.core.recompute import Recomputed, select_tokens, selected_count
from kamera_agent.core.staging import Committed, StagedStore
from kamera_agent.critical_path import books, to_device
from kamera_agent.errors import ChunkLostError, ContextOverflowError, ForeignChunkError, UnsupportedModelError
from kamera_agent.operator.layout import ChunkKV, to_position_free, to_position_free_many
from kamera_agent.operator.patch import Patch, apply_patch, form_patch, place_many
from kamera_agent.results import Answer
from kamera_agent.store import ChunkStore

__all__ = ["KVCore", "StaleLookup", "Txn"]


class StaleLookup(Exception):
    """A store entry an operation planned on changed while it ran (an orbit another window merged
    into, a mean KV that left the store): internal, the window plans the operation again."""


@dataclass
class Txn:
    """One operation's store view and cost meter, passed to every core call it makes.

    As a context manager it commits when the block succeeds and discards otherwise:

        with core.txn() as txn:
            kv = core.canonical(chunk, txn)
    """

    store: StagedStore
    meter: CostMeter = field(default_factory=CostMeter)
    device: torch.device | None = field(default=None, init=False, repr=False)
    """The engine's device, read once per op (`KVCore.device`)."""

    def commit(self) -> Committed:
        """Store what the op staged; entries too large for the budget are counted as uncached."""
        done = self.store.commit()
        self.meter.add(bytes_added=done.nbytes)
        self.meter.add(uncached=done.uncached)
        return done

    def discard(self) -> None:
        """Drop what the op staged: the store stays as it was."""
        self.store.discard()

    def __enter__(self) -> Txn:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


class KVCore:
    """Chunks' KV for one backend over one store: canonicals, conditioned KV, placement, decoding.

    Args:
        backend: the engine's primitives.
        store: the content-addressed store of this model (fingerprints must match).
        encoder: what prepares this window's chunks, its anchor included (default the backend's;
            a conversation window's has its own system prompt).

    Raises:
        ForeignChunkError: the store holds KV of another model.
        UnsupportedModelError: an MLA model on an engine that does not run MLA.
    """

    def __init__(self, backend: Backend, store: ChunkStore, encoder: ChunkEncoder | None = None) -> None:
        if store.fingerprint != backend.fingerprint:
            raise ForeignChunkError(
                "this store holds KV of another model (fingerprints differ); open one store per model "
                "(a separate disk_dir) or pass no store"
            )
        if backend.layout.kind == "mla" and not backend.supports_mla:
            raise UnsupportedModelError(
                f"{type(backend).__name__} does not run MLA models ({backend.layout.name}); use a backend "
                "that does (TransformersBackend runs DeepSeek-V2/V3)"
            )
        self.backend, self.store = backend, store
        self.encoder = encoder or backend.encoder
        self.anchor = self.encoder.anchor()
        self.root = Context.root(self.anchor.key)
        self._anchor_kv: ChunkKV | None = None

    def txn(self) -> Txn:
        """A fresh transaction over the store."""
        return Txn(StagedStore(self.store))

    def _prefill(self, *args: Any, **kwargs: Any) -> Prefilled:
        """``backend.prefill``, timed: the store's lookup deadlines scale with its time per token."""
        began = time.perf_counter()
        done = self.backend.prefill(*args, **kwargs)
        self.store.deadlines.observe(done.spent.tokens_prefilled, time.perf_counter() - began)
        return done

    # -- the anchor ---------------------------------------------------------------------------
    @property
    def anchor_ready(self) -> bool:
        """Whether the anchor's KV is computed (the first forward of a window also runs it)."""
        return self._anchor_kv is not None

    def anchor_kv(self, meter: CostMeter) -> ChunkKV:
        """The anchor's KV at positions ``[0, anchor.advance)``: one forward, the first time."""
        if self._anchor_kv is None:
            done = self._prefill([self.anchor], [], 0)
            meter.spend(done.spent)
            self._anchor_kv = done.kv[0]
        return self._anchor_kv

    # -- canonicals and vision outputs --------------------------------------------------------
    def canonical(self, chunk: Chunk, txn: Txn) -> ChunkKV:
        """``KV(B|∅)``, position-free: from the store, else one prefill behind the anchor (stored)."""
        self.check_origin(chunk)
        hit = txn.store.get_canonical(chunk.key)
        if hit is not None:
            return self.on_device(hit, txn)
        if not self.anchor_ready:  # the window's first forward: the anchor runs in it
            done = self.condition([chunk], [], self.anchor.advance, txn)
            return self.store_canonical(chunk, done.kv[0], txn)
        vision = [self.vision(chunk, txn)] if chunk.has_vision else []
        done = self._prefill([chunk], [self.anchor_kv(txn.meter)], self.anchor.advance, vision)
        txn.meter.spend(done.spent)
        return self.store_canonical(chunk, done.kv[0], txn)

    def store_canonical(self, chunk: Chunk, conditioned: ChunkKV, txn: Txn) -> ChunkKV:
        """The canonical from a forward that computed it (the chunk right behind the anchor, at
        the anchor's end: a re-prefill from a window's first slot computes it with the chunks
        after it), position-free, stored."""
        txn.meter.prefilled.add(chunk.key)
        txn.meter.add(canonicals_formed=1)
        canonical = self._position_free(conditioned, chunk.key)
        txn.store.put_canonical(canonical)
        return canonical

    def vision(self, chunk: Chunk, txn: Txn) -> VisionFeatures:
        """The vision tower's outputs for the chunk's pixels: from the store, else computed (stored)."""
        assert chunk.vision_key is not None
        hit = txn.store.get_vision(chunk.vision_key)
        if hit is not None:
            device = self.device(txn)
            return {name: to_device(t, device) for name, t in hit.items()}
        if not chunk.has_pixels:
            raise ChunkLostError(
                f"chunk {chunk.label or chunk.key[:12]} released its pixels and the store no longer holds "
                "its canonical or vision output; push the content again (a disk tier holds evicted chunks)"
            )
        done = self.backend.encode_vision(chunk)
        txn.meter.spend(done.spent)
        txn.store.put_vision(chunk.vision_key, done.features)
        return done.features

    # -- conditioned KV -----------------------------------------------------------------------
    def condition(
        self,
        chunks: Sequence[Chunk],
        context: Sequence[ChunkKV],
        start: int,
        txn: Txn,
        onto: Any | None = None,
        *,
        starts: Sequence[int] | None = None,
        sees: Sequence[int] | None = None,
    ) -> Prefilled:
        """``KV(B_i | context, B_<i)`` of consecutive chunks from ``start`` (the anchor first in
        ``onto`` or ``context``): one forward, each chunk at its positions; with it the engine
        cache it ran over, where the engine retains one; ``starts``/``sees`` for runs with placed
        chunks between their members (``Backend.prefill``).

        With nothing before the chunks (no ``context``, no ``onto``, ``start`` at the anchor's
        end) and the anchor not yet computed, the anchor runs first in the same forward: a
        window's first forward is then one, as a prefix cache's is."""
        for chunk in chunks:
            self.check_origin(chunk)
        vision = [self.vision(chunk, txn) for chunk in chunks if chunk.has_vision]
        lead = not self.anchor_ready and not context and onto is None and starts is None
        if lead and start == self.anchor.advance:
            done = self._prefill([self.anchor, *chunks], [], 0, vision)
            txn.meter.spend(done.spent)
            self._anchor_kv = done.kv[0]
            return replace(done, kv=done.kv[1:])
        done = self._prefill(chunks, context, start, vision, onto, starts=starts, sees=sees)
        txn.meter.spend(done.spent)
        return done

    def recompute(
        self,
        chunk: Chunk,
        kv: ChunkKV,
        context: Sequence[ChunkKV],
        start: int,
        fraction: float,
        txn: Txn,
        layers: int = 1,
        head: bool = False,
    ) -> Recomputed:
        """``kv`` (the chunk placed at ``start``) with its most deviating ``fraction`` of tokens
        recomputed over ``context``: a partial forward of every token (`Backend.deviation`, the
        first ``layers`` layers), `select_tokens`, then one forward of those tokens
        (`Backend.recompute`); both costs land in ``txn.meter``. A fraction that selects every
        token skips the probe: that recompute is the chunk's exact prefill over ``context``.
        ``head``: its first ``fraction`` of tokens instead, no probe (after a change to its left
        they drifted most: `benchmarks/slide_repair.py`)."""
        self.check_origin(chunk)
        vision = self.vision(chunk, txn) if chunk.has_vision else None
        n = chunk.num_tokens
        scores = None
        with books("the tokens a recompute runs are chosen by their deviation, and checked, on the host"):
            if head:
                indices = torch.arange(selected_count(fraction, n))
            elif selected_count(fraction, n) < n:
                probe = self.backend.deviation(chunk, kv, context, start, vision, layers)
                txn.meter.spend(probe.spent)
                scores = probe.scores
                indices = select_tokens(scores, fraction)
            else:
                indices = torch.arange(n)
            done = self.backend.recompute(chunk, kv, indices, context, start, vision)
        txn.meter.spend(done.spent)
        return Recomputed(done.kv[0], indices, scores)

    # -- forming a state's KV -------------------------------------------------------------------
    def store_full(
        self, state: ChunkState, conditioned: ChunkKV, txn: Txn, *, orbit: bool = False
    ) -> ChunkKV:
        """A full-rank state's KV from the forward that computed it: position-free, stored under
        the state (no canonical needed: smaller than full-rank factors), folded into its orbit."""
        kv = self._position_free(conditioned, state.chunk_key)
        txn.store.put_full(kv, state.digest)
        if orbit:
            fold_full_orbit(txn.store, self.root, state, kv)
        return kv

    def position_free(self, conditioned: Sequence[ChunkKV]) -> list[ChunkKV]:
        """One forward's chunks un-rotated together (`to_position_free_many`): what `store_full`,
        `store_patch` and `store_canonical` then store as they are, with no rotation of their own."""
        return to_position_free_many(conditioned, self.backend.layout)

    def _position_free(self, conditioned: ChunkKV, chunk_key: str) -> ChunkKV:
        """``conditioned`` as stored: position-free, filed under its chunk's key and carrying the
        model's fingerprint (the store stamps an entry without one with a copy at commit)."""
        free = to_position_free(conditioned, self.backend.layout)
        if free.chunk_key == chunk_key and free.model_fingerprint:
            return free  # un-rotated with its forward's run (`position_free`), filed already
        fingerprint = free.model_fingerprint or self.backend.fingerprint
        return ChunkKV(free.keys, free.values, None, chunk_key, fingerprint)

    def store_patch(
        self, canonical: ChunkKV, state: ChunkState, conditioned: ChunkKV, txn: Txn, *, orbit: bool = False
    ) -> Patch:
        """A rank-m state's patch: the deficit of the forward's KV against the canonical, truncated
        to the state's rank, stored under the state and folded into its orbit."""
        patch = form_patch(canonical, conditioned, self.backend.layout, state.rank, state=state.digest)
        txn.store.put_patch(patch)
        if orbit:
            fold_orbit(txn.store, self.root, state, patch)
        return patch

    def stored_patch(self, state: ChunkState, variant: str, txn: Txn) -> Patch | None:
        """The stored patch that gives ``state`` (filed under ``variant``), or ``None``: form it.

        An orbit is filed by its set, so what is filed there can change: only the planned one is
        served (this op may have merged a member into it since planning; the committed one is
        older); anything else raises `StaleLookup`.
        """
        if state.kind != "orbit":
            return txn.store.get_patch(state.chunk_key, variant)
        for source in (txn.store, txn.store.store):
            patch = source.get_patch(state.chunk_key, variant)
            if patch is not None and patch.state == state.digest:
                return patch
        raise StaleLookup(f"the orbit patch {state.digest[:8]} of {state.chunk_key[:12]}… changed")

    def stored_full(self, state: ChunkState, txn: Txn) -> ChunkKV | None:
        """The stored KV of full-rank ``state`` on the engine's device, or ``None``: form it (a mean
        KV of an orbit cannot be formed again from one ordering: `StaleLookup`)."""
        kv = txn.store.get_full(state.chunk_key, state.stored_as)
        if kv is None and state.kind == "orbit":
            raise StaleLookup(f"the mean KV of orbit {state.digest[:8]} left the store")
        return None if kv is None else self.on_device(kv, txn)

    def place(self, canonical: ChunkKV, patch: Patch | None, positions: torch.Tensor) -> ChunkKV:
        """The chunk at ``positions`` with its conditioning restored: rotate(canonical + patch)."""
        return apply_patch(canonical, patch, self.backend.layout, positions)

    def place_many(self, chunks: Sequence[tuple[ChunkKV, Patch | None, torch.Tensor]]) -> list[ChunkKV]:
        """Several chunks placed with one rotation over all their tokens (see `place_many`)."""
        return place_many(chunks, self.backend.layout)

    # -- answering ----------------------------------------------------------------------------
    def check_fits(self, end: int, query_ids: torch.Tensor, config: DecodeConfig) -> None:
        """Raise `ContextOverflowError` unless window + query + answer fit the model's context."""
        limit = self.backend.context_limit
        needed = end + int(query_ids.shape[0]) + config.max_new_tokens
        if limit is not None and needed > limit:
            raise ContextOverflowError(
                f"window ({end} positions) + query ({query_ids.shape[0]} tokens) + answer "
                f"({config.max_new_tokens}) needs {needed} positions; the model has {limit}. Slide or evict "
                "chunks, or shorten the query"
            )

    def decode(
        self, cache: Any, query_ids: torch.Tensor, end: int, config: DecodeConfig, meter: CostMeter
    ) -> Answer:
        """Answer the query placed at ``end`` over an assembled ``cache`` (anchor first)."""
        self.check_fits(end, query_ids, config)
        done = self.backend.decode(cache, query_ids, end, config)
        meter.spend(done.spent)
        return done.answer

    # -- checks -------------------------------------------------------------------------------
    def check_origin(self, chunk: Chunk) -> None:
        """Refuse a chunk prepared for another model or processing setting (a string compare:
        the chunk carries the digest its content key was made with)."""
        if chunk.origin != self.encoder.origin:
            raise ForeignChunkError(
                f"chunk {chunk.key[:12]}… was prepared for another model or processor setting; "
                "re-create it with this window's encoder (window.push does this for you)"
            )

    def device(self, txn: Txn) -> torch.device:
        """The engine's device, read once per op: a backend's device is a walk over its parameters."""
        if txn.device is None:
            txn.device = self.backend.device
        return txn.device

    def on_device(self, kv: ChunkKV, txn: Txn) -> ChunkKV:
        """``kv`` on the engine's device (entries read back from a disk tier live on the CPU)."""
        device = self.device(txn)
        if kv.keys.device == device:
            return kv
        return replace(kv, keys=to_device(kv.keys, device), values=to_device(kv.values, device))
