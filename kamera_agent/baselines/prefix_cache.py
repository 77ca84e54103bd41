"""The prefix-cache baseline, run for real and at its best: crop at the first change, re-prefill
the rest, with vision-tower outputs cached by content.

Why a real one: a prefix cache (vLLM's, SGLang's radix tree) reuses KV only while the token
sequence's prefix is unchanged. After a slide, a reorder or a recall, everything from the first
changed slot must be prefilled again. We keep a transformers ``DynamicCache`` of the window's
sequence, crop it there and run the model's language model over the rest, with the window's
own position ids.

Why an encoder cache: vLLM and SGLang also cache the vision encoder's outputs by a hash of the
image, so an image re-prefilled after a move does not run the vision tower again. So does this
baseline (``cache_vision=True``, the default), keyed by the chunk's ``vision_key`` (a hash of
the preprocessed pixels and the processing settings): its forward embeds the tokens, writes the
image features over the image-placeholder embeddings and runs the decoder and LM head, which is
what the model's own top-level forward does (``get_image_features``, scatter, language model).
The suites check it against the model's own re-prefill (``baseline_logit_error``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.baselines.clock import wall
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.results import Answer

__all__ = ["Answered", "PrefixCache", "Sync"]


@dataclass(frozen=True)
class Sync:
    """What bringing the cache up to date cost.

    Attributes:
        tokens: tokens prefilled.
        seconds: wall time of the whole sync (crop, vision, forward).
        reused: cache slots reused from the previous sequence.
        forwards: language-model forwards (0 when nothing changed, else 1).
        vision_runs: vision-tower runs (images whose features were not cached yet).
    """

    tokens: int
    seconds: float
    reused: int
    forwards: int = 0
    vision_runs: int = 0


@dataclass(frozen=True)
class Answered:
    """A query prefilled after the cached sequence: its next-token logits and what that cost."""

    logits: torch.Tensor
    tokens: int
    seconds: float
    forwards: int = 1
    answer: Answer | None = None
    """The decoded answer (`PrefixCache.answer`); ``None`` when only the logits were computed."""


@dataclass
class PrefixCache:
    """A prefix cache over ``anchor + chunks`` for one backend's model.

    Attributes:
        backend: where the model, the anchor and the position scheme come from.
        cache_vision: keep vision-tower outputs by ``vision_key`` (an encoder cache, as vLLM and
            SGLang do); ``False`` re-runs the tower for every image it re-prefills.
        keys: content keys of the chunks the cache holds, anchor first.
        end: the position after the last cached chunk (where a query starts).
        vision_runs: vision-tower runs so far.
    """

    backend: TransformersBackend
    cache_vision: bool = True
    keys: list[str] = field(default_factory=list)
    end: int = 0
    vision_runs: int = 0
    _cache: Any = None
    _vision: dict[str, Mapping[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    def sync(self, chunks: Sequence[Chunk]) -> Sync:
        """Make the cache hold ``anchor + chunks``: crop at the first changed chunk, prefill the rest.

        Mutates: the cache, `keys` and the vision cache.
        """
        began, runs = wall(), self.vision_runs
        sequence = [self.backend.anchor, *chunks]
        same = 0
        while same < min(len(self.keys), len(sequence)) and self.keys[same] == sequence[same].key:
            same += 1
        reused = sum(chunk.num_tokens for chunk in sequence[:same])
        self._crop(reused)
        start = sum(chunk.advance for chunk in sequence[:same])
        tokens = self._prefill(sequence[same:], start) if same < len(sequence) else 0
        self.keys = [chunk.key for chunk in sequence]
        self.end = sum(chunk.advance for chunk in sequence)
        seconds = wall() - began
        return Sync(tokens, seconds, reused, int(tokens > 0), self.vision_runs - runs)

    def ask(self, query_ids: torch.Tensor) -> Answered:
        """The query placed after the cached sequence: one forward, its next-token logits (the
        query's KV is appended; the next `sync` crops it off)."""
        began = wall()
        positions = self.backend.positions.text(self.end, int(query_ids.shape[0]))
        logits = self._forward(query_ids, torch.zeros_like(query_ids), positions, None)
        assert logits is not None
        self.keys.append("query")
        return Answered(logits, int(query_ids.shape[0]), wall() - began)

    def answer(self, query_ids: torch.Tensor, config: DecodeConfig) -> Answered:
        """The query decoded after the cached sequence as ``config`` says: the backend's own
        decode loop over this cache, the one a window's ``ask`` runs (so both sides of a
        comparison decode the same answer the same way). The query's and the answer's KV are
        appended; the next `sync` crops them off."""
        began = wall()
        done = self.backend.decode(self._cache, query_ids, self.end, config)
        self.keys.append("query")
        answer, seconds = done.answer, wall() - began
        return Answered(
            answer.first_logits.cpu(), int(query_ids.shape[0]), seconds, done.spent.forwards, answer
        )

    def first_logits(self, query_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits of ``query_ids`` placed after the cached sequence (appends to the cache)."""
        return self.ask(query_ids).logits

    def _crop(self, length: int) -> None:
        if self._cache is None or length == 0:
            self._cache = self.backend.empty_cache()  # appends cost the new tokens, as a paged cache's do
            return
        surplus = self._cache.get_seq_length() - length
        if surplus > 0:
            self._cache.crop(-surplus)  # negative: "remove this many" in every supported transformers

    def _prefill(self, chunks: Sequence[Chunk], start: int) -> int:
        """One forward over ``chunks`` from position ``start``; returns the tokens prefilled."""
        ids, types, positions = [], [], []
        for chunk in chunks:
            ids.append(chunk.input_ids)
            types.append(chunk.mm_token_type_ids)
            positions.append(chunk.positions_at(start))
            start += chunk.advance
        features = [self._features(chunk) for chunk in chunks if chunk.has_vision]
        vision = {name: torch.cat([f[name] for f in features]) for name in features[0]} if features else None
        input_ids = torch.cat(ids)
        self._forward(input_ids, torch.cat(types), torch.cat(positions, dim=-1), vision, logits=False)
        return int(input_ids.shape[0])

    def _features(self, chunk: Chunk) -> Mapping[str, torch.Tensor]:
        """The chunk's vision-tower outputs: from the encoder cache, else one tower run."""
        assert chunk.vision_key is not None
        hit = self._vision.get(chunk.vision_key)
        if hit is not None:
            return hit
        features = self.backend.encode_vision(chunk).features
        self.vision_runs += 1
        if self.cache_vision:
            self._vision[chunk.vision_key] = features
        return features

    def _forward(
        self,
        input_ids: torch.Tensor,
        mm_types: torch.Tensor,
        positions: torch.Tensor,
        vision: Mapping[str, torch.Tensor] | None,
        *,
        logits: bool = True,
    ) -> torch.Tensor | None:
        """The backend's own forward over the cache; the last token's logits where asked (a sync
        prefills without them, as a window's forwards do: an engine's prefill of a request
        computes them once, for the question)."""
        self._cache, last = self.backend.forward(
            input_ids, mm_types, positions, self._cache, vision, logits=logits
        )
        return None if last is None else last.cpu()
