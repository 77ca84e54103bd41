"""What a chunk state says its KV is, computed independently of the window: the graph is the truth.

A window records, for every chunk, a `ChunkState`: its content, how it is patched and the chained
states of its antecedents. This oracle rebuilds the KV each state names from the engine's own
prefill, never through the window's planner, executor, store or placement code:

- canonical: the chunk prefilled behind the anchor, un-rotated;
- patched over a context: the chunk prefilled behind the anchor and the *truth* of each antecedent
  state placed back to back; its deficit over the canonical truncated to the state's rank by a
  plain SVD per layer and slot (no truncation at rank ``"full"``);
- orbit: the running mean of its members' truncated deficits, re-truncated after each member,
  in the order the members were merged (what an orbit patch is by definition);
- recomputed: the truth of its source placed behind the truth of its context, the chunk's
  ``ceil(share · n)`` tokens of largest one-layer deviation there (`Backend.deviation`), or its
  first ``ceil(share · n)`` (``head``), recomputed through every layer (`Backend.recompute`).

States and chunks are learned from every window a test touches (`learn`), so a state formed in
one window and served in another is checked against the same truth. Truths are memoised by the
oracle's own structural key of a state (its content and its antecedents' keys, recursively),
never by the library's digest: two states whose digests collide but whose chains differ get
different truths, so a digest that forgets part of a chain is caught.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from kamera_agent.backends.base import Backend
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.core.identity import ChunkState
from kamera_agent.operator.layout import ChunkKV, relocate, to_position_free
from kamera_agent.window import KameraWindow
from tests.kv_helpers import rel_err


class StateOracle:
    """The truth of every state seen, memoised by digest."""

    def __init__(self, backend: Backend, anchor: Chunk | None = None) -> None:
        self.backend, self.layout = backend, backend.layout
        self.anchor = anchor or backend.encoder.anchor()
        self.anchor_kv = backend.prefill([self.anchor], [], 0).kv[0]
        self.chunks: dict[str, Chunk] = {}
        self.states: dict[str, ChunkState] = {}
        self._free: dict[object, ChunkKV] = {}

    def know(self, chunk: Chunk) -> None:
        """Remember a pushed chunk (with its pixels) by content key."""
        self.chunks.setdefault(chunk.key, chunk)

    def learn(self, window: KameraWindow) -> None:
        """Remember every state the window's chunks hold, and their antecedents' states."""
        for ref in window.graph.nodes:
            self._learn(window.state_of(ref))

    def _learn(self, state: ChunkState) -> None:
        if state.digest in self.states:
            return
        self.states[state.digest] = state
        for antecedent in state.antecedents():
            self._learn(antecedent)

    # -- truth ------------------------------------------------------------------------------
    def placed(self, state: ChunkState, start: int) -> ChunkKV:
        """The state's KV with the chunk starting at ``start``."""
        chunk = self.chunks[state.chunk_key]
        return relocate(self.free(state), self.layout, chunk.positions_at(start))

    def free(self, state: ChunkState) -> ChunkKV:
        """The state's KV, position-free."""
        key = _structure(state)
        if key not in self._free:
            self._free[key] = self._compute(state)
        return self._free[key]

    def _compute(self, state: ChunkState) -> ChunkKV:
        canonical = self._canonical(state.chunk_key)
        if state.kind == "canonical":
            return canonical
        if state.kind == "recomputed":
            return self._recomputed(state)
        if state.kind == "patched":
            conditioned = self._conditioned(state)
            if state.rank == "full":
                return conditioned
            return _plus(canonical, _truncated(_minus(conditioned, canonical), int(state.rank)))
        mean: dict[str, torch.Tensor] | None = None
        for count, member in enumerate(state.members, start=1):
            deficit = _minus(self.free(self.states[member]), canonical)
            if mean is None:
                mean = deficit
            else:
                mean = {slot: (mean[slot] * (count - 1) + deficit[slot]) / count for slot in deficit}
            if state.rank != "full":
                mean = _truncated(mean, int(state.rank))
        assert mean is not None
        return _plus(canonical, mean)

    def _canonical(self, chunk_key: str) -> ChunkKV:
        digest = ("canonical", chunk_key)
        if digest not in self._free:
            chunk = self.chunks[chunk_key]
            kv = self._prefill(chunk, [self.anchor_kv], self.anchor.advance)
            self._free[digest] = to_position_free(kv, self.layout)
        return self._free[digest]

    def _conditioned(self, state: ChunkState) -> ChunkKV:
        context, start = self._context(state)
        chunk = self.chunks[state.chunk_key]
        return to_position_free(self._prefill(chunk, context, start), self.layout)

    def _context(self, state: ChunkState) -> tuple[list[ChunkKV], int]:
        """The truths of the state's context placed behind the anchor, and where the chunk starts."""
        context, start = [self.anchor_kv], self.anchor.advance
        for antecedent in state.context.states():
            context.append(self.placed(antecedent, start))
            start += self.chunks[antecedent.chunk_key].advance
        return context, start

    def _recomputed(self, state: ChunkState) -> ChunkKV:
        assert state.source is not None
        context, start = self._context(state)
        chunk = self.chunks[state.chunk_key]
        source = self.placed(state.source, start)
        vision = self.backend.encode_vision(chunk).features if chunk.has_vision else None
        count = math.ceil(round(state.share * chunk.num_tokens, 9))
        if state.head:
            indices = torch.arange(count)
        else:
            scores = self.backend.deviation(chunk, source, context, start, vision, 1).scores
            indices = torch.topk(scores.float().cpu(), count).indices.sort().values
        kv = self.backend.recompute(chunk, source, indices, context, start, vision).kv[0]
        return to_position_free(kv, self.layout)

    def _prefill(self, chunk: Chunk, context: list[ChunkKV], start: int) -> ChunkKV:
        vision = [self.backend.encode_vision(chunk).features] if chunk.has_vision else []
        return self.backend.prefill([chunk], context, start, vision).kv[0]

    # -- checks -------------------------------------------------------------------------------
    def errors(self, window: KameraWindow) -> dict[str, tuple[float, ChunkState]]:
        """Per in-window chunk: the worst per-layer relative error of its KV against its state's truth."""
        self.learn(window)
        out, start = {}, self.anchor.advance
        for ref in window.refs:
            state = window.state_of(ref)
            want, got = self.placed(state, start), window.chunk_kv(ref)
            error = max(
                rel_err(getattr(got, slot)[layer], getattr(want, slot)[layer])
                for layer in range(want.keys.shape[0])
                for slot in ("keys", "values")
            )
            out[ref.label] = (error, state)
            start += window.chunk(ref).advance
        return out


def _structure(state: ChunkState) -> object:
    """What the state says, as a nested tuple built here (independent of the library's digests)."""
    if state.kind == "canonical":
        return ("canonical", state.chunk_key)
    if state.kind == "orbit":
        return ("orbit", state.chunk_key, state.rank, state.address, state.members)
    if state.kind == "recomputed":
        assert state.source is not None
        context = tuple(_structure(a) for a in state.context.states())
        return ("recomputed", state.chunk_key, state.share, state.head, _structure(state.source), context)
    return ("patched", state.chunk_key, state.rank, tuple(_structure(a) for a in state.context.states()))


def _matrix(slot: torch.Tensor) -> torch.Tensor:
    layers, heads, n, dim = slot.shape  # [L, H, n, D] -> [L, n, H·D]
    return slot.to(torch.float64).transpose(1, 2).reshape(layers, n, heads * dim)


def _minus(a: ChunkKV, b: ChunkKV) -> dict[str, torch.Tensor]:
    return {slot: _matrix(getattr(a, slot)) - _matrix(getattr(b, slot)) for slot in ("keys", "values")}


def _plus(base: ChunkKV, deficit: dict[str, torch.Tensor]) -> ChunkKV:
    out = {}
    for slot, delta in deficit.items():
        tensor = getattr(base, slot)
        layers, heads, n, dim = tensor.shape
        back = delta.reshape(layers, n, heads, dim).transpose(1, 2)
        out[slot] = (tensor.to(torch.float64) + back).to(tensor.dtype)
    return replace(base, keys=out["keys"], values=out["values"])


def _truncated(deficit: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Each layer's ``[n, F]`` deficit cut to its top ``rank`` singular directions."""
    out = {}
    for slot, matrices in deficit.items():
        u, s, vh = torch.linalg.svd(matrices, full_matrices=False)
        out[slot] = (u[..., :rank] * s[..., None, :rank]) @ vh[..., :rank, :]
    return out
