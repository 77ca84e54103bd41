"""The model's own re-prefill after every op of an episode, from the first chunk the op changed.

Why: a calibration compares every op's window with the model's own forward over the same
lineup, and that forward is most of its time. Between two ops the lineup's leading chunks are
often the same (a reorder or recall behind them, a push into a window with room), and the
model's KV for them is the same too, so the previous re-prefill's cache is cut back to them
and the model's own forward runs on from there: what an incremental prefill computes, equal to
the one-shot re-prefill up to rounding. Where positions are not consecutive token counts (a
vision model) or layers attend within a window (their KV is read by slot), it re-prefills whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kamera_agent.backends.base import Reference
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.compat import cache_kwarg, last_logits_only, output_cache

__all__ = ["Truth"]


class Truth:
    """`TransformersBackend.reference_prefill` for a sequence of lineups, each from where it
    first differs from the one before."""

    def __init__(self, backend: TransformersBackend) -> None:
        self.backend = backend
        self.reuses = backend.sliding is None and not backend.parts.has_vision  # input_ids alone
        self._keys: list[str] = []
        self._cache: Any = None
        self.tokens = 0
        """Tokens the re-prefills have run (the query's included)."""

    def __call__(self, chunks: Sequence[Chunk], query_ids: torch.Tensor) -> Reference:
        """The model's own forward over anchor, ``chunks`` and the query: every chunk's KV and
        the next-token logits."""
        backend = self.backend
        placed = [backend.anchor, *chunks]
        if not self.reuses:
            self.tokens += sum(chunk.num_tokens for chunk in placed) + int(query_ids.shape[0])
            return backend.reference_prefill(chunks, query_ids)
        inputs = backend.reference_inputs(chunks, query_ids)
        keys = [chunk.key for chunk in placed]
        same = _shared(self._keys, keys)
        reused = sum(chunk.num_tokens for chunk in placed[:same]) if self._cache is not None else 0
        surplus = self._cache.get_seq_length() - reused if reused else 0
        if surplus:
            self._cache.crop(-surplus)  # transformers' crop takes the tokens to remove, negated
        ids = inputs["input_ids"][:, reused:]
        after = {cache_kwarg(backend.model): self._cache} if reused else {}
        with torch.no_grad():
            out = backend.model(input_ids=ids, use_cache=True, **after, **last_logits_only(backend.model))
        self._cache, self._keys = output_cache(out), keys
        self.tokens += int(ids.shape[1])
        return Reference(backend.read_placed(self._cache, placed), out.logits[0, -1].float().cpu())


def _shared(before: Sequence[str], now: Sequence[str]) -> int:
    """How many leading keys two lineups share."""
    count = 0
    for a, b in zip(before, now, strict=False):
        if a != b:
            break
        count += 1
    return count
