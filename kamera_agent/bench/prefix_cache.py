"""The prefix-cache baseline of the window suite, run for real: crop at the first change, re-prefill.

Why a real one: a prefix cache (vLLM's, SGLang's radix tree) reuses KV only while the token
sequence's prefix is unchanged. After a slide, a reorder or a recall, everything from the first
changed slot must be prefilled again. We keep a transformers ``DynamicCache`` of the window's
sequence, crop it there and run the model's own forward over the rest (vision tower included,
as a prefix cache without an encoder-output cache does), with the window's own position ids.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.compat import cache_kwarg

__all__ = ["PrefixCache", "Sync"]


@dataclass(frozen=True)
class Sync:
    """What bringing the cache up to date cost: tokens prefilled, seconds, slots kept."""

    tokens: int
    seconds: float
    kept: int


@dataclass
class PrefixCache:
    """A prefix cache over ``anchor + chunks`` for one backend's model.

    Attributes:
        backend: where the model, the anchor and the position scheme come from.
        keys: content keys of the chunks the cache holds, anchor first.
        end: the position after the last cached chunk (where a query starts).
    """

    backend: TransformersBackend
    keys: list[str] = field(default_factory=list)
    end: int = 0
    _cache: Any = None

    def sync(self, chunks: Sequence[Chunk]) -> Sync:
        """Make the cache hold ``anchor + chunks``: crop at the first changed chunk, prefill the rest.

        Mutates: the cache and `keys`.
        """
        began = time.perf_counter()
        sequence = [self.backend.anchor, *chunks]
        same = 0
        while same < min(len(self.keys), len(sequence)) and self.keys[same] == sequence[same].key:
            same += 1
        kept = sum(chunk.num_tokens for chunk in sequence[:same])
        self._crop(kept)
        start = sum(chunk.advance for chunk in sequence[:same])
        tokens = self._prefill(sequence[same:], start) if same < len(sequence) else 0
        self.keys = [chunk.key for chunk in sequence]
        self.end = sum(chunk.advance for chunk in sequence)
        return Sync(tokens, time.perf_counter() - began, kept)

    def first_logits(self, query_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits of ``query_ids`` placed after the cached sequence (appends to the cache)."""
        positions = self.backend.positions.text(self.end, int(query_ids.shape[0]))
        logits = self._forward(query_ids, positions, {})
        self.keys.append("query")
        return logits

    def _crop(self, keep: int) -> None:
        if self._cache is None or keep == 0:
            from transformers import DynamicCache

            self._cache = DynamicCache(config=self.backend.model.config)
            return
        surplus = self._cache.get_seq_length() - keep
        if surplus > 0:
            self._cache.crop(-surplus)  # negative: "remove this many" in every supported transformers

    def _prefill(self, chunks: Sequence[Chunk], start: int) -> int:
        """One forward over ``chunks`` from position ``start``; returns the tokens prefilled."""
        ids, positions = [], []
        for chunk in chunks:
            ids.append(chunk.input_ids)
            positions.append(chunk.positions_at(start))
            start += chunk.advance
        vision = [chunk for chunk in chunks if chunk.has_vision]
        extra: dict[str, Any] = {}
        if vision:
            extra["pixel_values"] = torch.cat([c.pixel_values for c in vision])  # type: ignore[misc]
            extra["image_grid_thw"] = torch.cat([c.image_grid_thw for c in vision])  # type: ignore[misc]
        input_ids = torch.cat(ids)
        self._forward(input_ids, torch.cat(positions, dim=-1), extra)
        return int(input_ids.shape[0])

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, extra: dict[str, Any]
    ) -> torch.Tensor:
        model = self.backend.model
        device = self.backend.parts.device
        pos = positions[None] if positions.ndim == 1 else positions[:, None]  # [1, n] or [3, 1, n]
        with torch.no_grad():
            out = model(
                input_ids=input_ids[None].to(device),
                position_ids=pos.to(device),
                use_cache=True,
                logits_to_keep=1,
                **{cache_kwarg(model): self._cache},
                **{key: value.to(device) for key, value in extra.items()},
            )
        logits: torch.Tensor = out.logits[0, -1].float().cpu()
        return logits
