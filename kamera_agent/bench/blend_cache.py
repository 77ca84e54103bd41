"""The token-recompute baseline (CacheBlend-style), run for real: every chunk's canonical KV
reused at its slot, the unchanged prefix kept, and a share of every later chunk's tokens
recomputed over what precedes it, chosen by the deviation rule a real system can run.

Why it is here: token recompute is the other way to restore cross-chunk conditioning (CacheBlend,
EPIC). Set beside the window on the same episode, with the same counting, it says where the
window's settings sit on the frontier of tokens against fidelity. It is run at its best as
such systems run: a prefix cache in front (the leading chunks that did not change keep their KV,
as vLLM's and SGLang's do), vision-tower outputs cached by content, each distinct content
prefilled once (over the anchor) and stored position-free, the selection from a one-layer
deviation probe (`Backend.deviation`, `kamera_agent.core.recompute.select_tokens`), no oracle.

What it pays per sync: the canonical prefill of content it has never seen, and for every chunk
from the first changed slot on, the probe (a partial forward worth ``ceil(n / layers)`` tokens)
and the forward of the selected tokens. A fraction of 1 recomputes every token: that is the
prefix cache's re-prefill, done chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kamera_agent.backends.base import Spent, VisionFeatures
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.baselines.prefix_cache import Sync
from kamera_agent.bench.common import wall
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.core.recompute import select_tokens, selected_count
from kamera_agent.operator.layout import ChunkKV, relocate, to_position_free

__all__ = ["BlendCache"]


@dataclass
class BlendCache:
    """Canonical reuse plus selective token recompute over ``anchor + chunks``.

    Attributes:
        backend: the model (its `Backend.recompute` and `Backend.deviation`).
        fraction: the share of each placed chunk's tokens recomputed, in (0, 1].
        layers: decoder layers the deviation probe runs (1: CacheBlend's cheapest useful probe).
    """

    backend: TransformersBackend
    fraction: float
    layers: int = 1
    _keys: list[str] = field(default_factory=list)
    _held: list[ChunkKV] = field(default_factory=list)
    _canonical: dict[str, ChunkKV] = field(default_factory=dict, repr=False)
    _vision: dict[str, VisionFeatures] = field(default_factory=dict, repr=False)
    _end: int = 0
    _spent: list[Spent] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        selected_count(self.fraction, 1)  # a fraction outside (0, 1] is refused here, by name

    def sync(self, chunks: Sequence[Chunk]) -> Sync:
        """Hold ``anchor + chunks``: keep the unchanged leading chunks; place every later one
        from its canonical KV and recompute its most deviating tokens over what precedes it.

        Mutates: what it holds, its canonical and vision caches.
        """
        began, self._spent = wall(), []
        sequence = [self.backend.anchor, *chunks]
        same = 0
        while same < min(len(self._keys), len(sequence)) and self._keys[same] == sequence[same].key:
            same += 1
        held, reused = self._held[:same], sum(chunk.num_tokens for chunk in sequence[:same])
        start = sum(chunk.advance for chunk in sequence[:same])
        for chunk in sequence[same:]:
            held.append(self._placed(chunk, held, start))
            start += chunk.advance
        self._keys, self._held, self._end = [chunk.key for chunk in sequence], held, start
        return Sync(
            tokens=sum(s.tokens_prefilled for s in self._spent),
            seconds=wall() - began,
            reused=reused,
            forwards=sum(s.forwards for s in self._spent),
            vision_runs=sum(s.vision_encodes for s in self._spent),
        )

    def first_logits(self, query_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits of ``query_ids`` placed after what it holds (one forward over the
        held KV, assembled into the engine's cache)."""
        cache = self.backend.assemble(self._held)
        positions = self.backend.positions.text(self._end, int(query_ids.shape[0]))
        _, logits = self.backend.forward(query_ids, torch.zeros_like(query_ids), positions, cache)
        assert logits is not None
        return logits.cpu()

    def _placed(self, chunk: Chunk, context: Sequence[ChunkKV], start: int) -> ChunkKV:
        """The chunk at ``start`` after ``context``: canonical, relocated, then blended (the
        anchor, which nothing precedes, is its own prefill)."""
        vision = self._features(chunk)
        if not context:
            done = self.backend.prefill([chunk], [], start, [vision] if vision is not None else [])
            self._spent.append(done.spent)
            return done.kv[0]
        canonical = self._canonical_of(chunk, context[0], vision)
        placed = relocate(canonical, self.backend.layout, chunk.positions_at(start))
        n = chunk.num_tokens
        if selected_count(self.fraction, n) < n:
            probe = self.backend.deviation(chunk, placed, context, start, vision, self.layers)
            self._spent.append(probe.spent)
            indices = select_tokens(probe.scores, self.fraction)
        else:
            indices = torch.arange(n)
        done = self.backend.recompute(chunk, placed, indices, context, start, vision)
        self._spent.append(done.spent)
        return done.kv[0]

    def _canonical_of(self, chunk: Chunk, anchor: ChunkKV, vision: VisionFeatures | None) -> ChunkKV:
        """The chunk prefilled once over the anchor's KV alone, position-free (stored by content)."""
        hit = self._canonical.get(chunk.key)
        if hit is None:
            done = self.backend.prefill(
                [chunk], [anchor], self.backend.anchor.advance, [vision] if vision is not None else []
            )
            self._spent.append(done.spent)
            hit = self._canonical[chunk.key] = to_position_free(done.kv[0], self.backend.layout)
        return hit

    def _features(self, chunk: Chunk) -> VisionFeatures | None:
        """The chunk's vision-tower outputs: from the encoder cache, else one tower run."""
        if not chunk.has_vision:
            return None
        assert chunk.vision_key is not None
        hit = self._vision.get(chunk.vision_key)
        if hit is None:
            out = self.backend.encode_vision(chunk)
            self._spent.append(out.spent)
            hit = self._vision[chunk.vision_key] = out.features
        return hit
