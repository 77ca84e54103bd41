"""The numerical floor: the same re-prefill in bf16 or fp16, against the fp32 one.

Why: a deployment serving a model in bf16 already accepts that its answers differ from fp32's
now and then; that disagreement is the noise floor any reuse is judged beside. "Answers like a
re-prefill" means nothing finer than the model's own rounding, so the window suite follows each
episode with this: after every op, the model cast to a lower precision re-prefills the whole
window and the question, and its first answer token is compared with the fp32 re-prefill's, as
every other side is (first-token agreement, KL, largest logit difference).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.baselines.prefix_cache import Sync
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.compat import last_logits_only

__all__ = ["FLOORS", "Floor"]

FLOORS = {"floor bf16": torch.bfloat16, "floor fp16": torch.float16}
"""The floors the window suite can follow an episode with, by side name."""


class Floor:
    """A full re-prefill of the window at ``dtype`` after every op (the fp32 model's weights
    cast once): what a deployment in that precision would answer."""

    def __init__(self, backend: TransformersBackend, dtype: torch.dtype) -> None:
        self.backend, self.dtype = backend, dtype
        self.model = copy.deepcopy(backend.model).to(dtype)
        self.chunks: list[Chunk] = []

    def sync(self, chunks: Sequence[Chunk]) -> Sync:
        """Hold the lineup; the re-prefill runs with the question (`first_logits`)."""
        started = time.perf_counter()
        self.chunks = list(chunks)
        tokens = sum(chunk.num_tokens for chunk in chunks)
        return Sync(tokens=tokens, seconds=time.perf_counter() - started, reused=0, forwards=1)

    def first_logits(self, query_ids: torch.Tensor) -> torch.Tensor:
        """The model's own forward at ``dtype`` over anchor, chunks and query: its next-token logits."""
        inputs = self.backend.reference_inputs(self.chunks, query_ids)
        if "pixel_values" in inputs:  # the vision tower runs at the floor's precision too
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        with torch.no_grad():
            logits: torch.Tensor = self.model(**inputs, **last_logits_only(self.model)).logits
        return logits[0, -1].float().cpu()
