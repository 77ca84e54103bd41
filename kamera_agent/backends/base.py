"""The backend seam: what kamera-agent needs from an inference engine, and nothing more.

Why a small ABC: the window and the planner never touch a model; a backend knows one engine
(transformers on CPU/GPU, SGLang's KV pool) and exposes five operations on chunks and caches.
Capability flags say what an engine can do instead of ``isinstance`` checks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.operator.layout import ChunkKV, KVLayout

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


@dataclass(frozen=True)
class Answer:
    """A decoded answer.

    Attributes:
        text: the generated text (special tokens and stop string removed).
        tokens: generated token ids.
        logits: ``[steps, vocab]`` float32 logits of each generated step, if asked for.
        first_logits: ``[vocab]`` logits of the first generated token (always kept: the basis of
            fidelity checks such as KL to re-prefill).
        finish_reason: ``"eos"``, ``"stop"`` or ``"length"``.
    """

    text: str
    tokens: list[int]
    first_logits: torch.Tensor
    logits: torch.Tensor | None = None
    finish_reason: str = "length"
    extra: dict[str, Any] = field(default_factory=dict)


class Backend(ABC):
    """An engine that encodes chunks, conditions them, assembles caches and decodes."""

    supports_mla: ClassVar[bool] = False
    supports_vision: ClassVar[bool] = False
    layout: KVLayout
    fingerprint: str
    counters: BackendCounters

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

    def condition_many(self, chunks: Sequence[tuple[Chunk, Sequence[ChunkKV], int]]) -> list[ChunkKV]:
        """Batched `condition`; engines that can batch override this."""
        return [self.condition(chunk, before, start) for chunk, before, start in chunks]
