"""The backend seam: what kamera-agent needs from an inference engine, and nothing more.

Why a small ABC: the window and the planner never touch a model; a backend knows one engine
(transformers on CPU/GPU, SGLang's KV pool) and exposes a handful of operations on chunks
and caches (encode, condition, assemble, decode, plus the anchor and reference inputs).
Capability flags say what an engine can do instead of ``isinstance`` checks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.operator.layout import ChunkKV, KVLayout
from kamera_agent.results import Answer
from kamera_agent.store import ChunkStore

__all__ = ["Answer", "Backend", "BackendCounters", "DecodeConfig"]


@dataclass
class BackendCounters:
    """What a backend has spent: the ground truth behind every op's reported cost."""

    lm_forwards: int = 0
    tokens_prefilled: int = 0
    vision_forwards: int = 0
    vision_cache_hits: int = 0
    canonical_hits: int = 0
    decode_steps: int = 0

    def snapshot(self) -> BackendCounters:
        return BackendCounters(**self.__dict__)

    def since(self, earlier: BackendCounters) -> BackendCounters:
        return BackendCounters(**{k: v - getattr(earlier, k) for k, v in self.__dict__.items()})


@dataclass(frozen=True)
class DecodeConfig:
    """How to generate an answer.

    Attributes:
        max_new_tokens: tokens to generate at most.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_k: sample among the k most likely tokens (0: all).
        top_p: nucleus sampling mass (1.0: all).
        seed: sampling seed, for reproducible samples.
        stop: strings that end the answer (not included in it).
        return_logits: keep the logits of every generated step.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    return_logits: bool = False


class Backend(ABC):
    """An engine that encodes chunks, conditions them, assembles caches and decodes."""

    supports_mla: ClassVar[bool] = False
    supports_vision: ClassVar[bool] = False
    layout: KVLayout
    fingerprint: str
    counters: BackendCounters
    encoder: ChunkEncoder
    store: ChunkStore

    @property
    @abstractmethod
    def anchor(self) -> Chunk:
        """The anchor chunk (system prompt, user-turn start) every window starts with."""

    @abstractmethod
    def anchor_kv(self) -> ChunkKV:
        """The anchor's KV at positions ``[0, anchor.advance)``."""

    @abstractmethod
    def reference_inputs(
        self, chunks: Sequence[Chunk], query_ids: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """The model's own forward inputs for a full re-prefill of ``anchor + chunks (+ query)``."""

    @abstractmethod
    def encode(self, chunk: Chunk) -> ChunkKV:
        """The chunk's canonical ``KV(B|∅)`` behind the anchor prefix, stored position-free."""

    @abstractmethod
    def condition(self, chunk: Chunk, before: Sequence[ChunkKV], start: int) -> ChunkKV:
        """``KV(B|A)``: the chunk's tokens prefilled at ``start`` over ``before`` (anchor first)."""

    @abstractmethod
    def assemble(self, placed: Sequence[ChunkKV]) -> Any:
        """An engine cache holding ``placed`` back to back (each already at its positions)."""

    @abstractmethod
    def decode(self, cache: Any, query_ids: torch.Tensor, start: int, config: DecodeConfig) -> Answer:
        """Answer ``query_ids`` placed at ``start`` over ``cache`` (which it may consume)."""

    def condition_run(self, chunks: Sequence[Chunk], before: Sequence[ChunkKV], start: int) -> list[ChunkKV]:
        """``KV(B_i | before, B_<i)`` for consecutive chunks from ``start``; engines that can
        prefill the run in one forward override this loop."""
        out: list[ChunkKV] = []
        for chunk in chunks:
            out.append(self.condition(chunk, [*before, *out], start))
            start += chunk.advance
        return out
