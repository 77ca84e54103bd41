"""The numerical floor: the same re-prefill in bf16 or fp16, against the fp32 one.

Why: a deployment serving a model in bf16 already accepts that its answers differ from fp32's
now and then; that disagreement is the noise floor any reuse is judged beside. "Answers like a
re-prefill" means nothing finer than the model's own rounding, so the window suite follows each
episode with this: after every op, the model cast to a lower precision re-prefills the whole
window and the question, and its first answer token is compared with the fp32 re-prefill's, as
every other side is (first-token agreement, KL, largest logit difference).

Where the hardware has no bf16 arithmetic (a CPU without AVX512-BF16 or AMX), a bf16 forward
costs about six fp32 ones; `Floor` can then *emulate* it: the weights and every module's inputs
and outputs rounded to the dtype, the arithmetic between them in fp32 (what bf16 kernels do,
which accumulate in fp32). Its first-token KL against fp32 is of the real cast's order (SmolLM2,
600 tokens: 1.5e-3 against 1.2e-3, 3.5e-4 against 2.8e-4), at fp32's cost.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.baselines.prefix_cache import Sync
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.compat import last_logits_only

__all__ = ["FLOORS", "Floor", "native_bf16"]

FLOORS = {"floor bf16": torch.bfloat16, "floor fp16": torch.float16}
"""The floors the window suite can follow an episode with, by side name."""


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bf16 natively (a CUDA GPU that supports it, a CPU with
    AVX512-BF16 or AMX), so that a bf16 forward costs no more than an fp32 one."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    cpu = torch.cpu
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, probe, lambda: False)()) for probe in probes)


class Floor:
    """A full re-prefill of the window at ``dtype`` after every op (the fp32 model's weights
    cast once): what a deployment in that precision would answer. ``emulate``: rounded to
    ``dtype`` around every module, computed in fp32 (the module docstring says when that serves)."""

    def __init__(self, backend: TransformersBackend, dtype: torch.dtype, *, emulate: bool = False) -> None:
        self.backend, self.dtype, self.emulate = backend, dtype, emulate
        self.model = copy.deepcopy(backend.model).to(dtype)
        if emulate:
            self.model.to(backend.model.dtype)
            _round_around_leaves(self.model, dtype)
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
        if "pixel_values" in inputs and not self.emulate:  # the vision tower runs at the floor's precision
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        with torch.no_grad():
            logits: torch.Tensor = self.model(**inputs, **last_logits_only(self.model)).logits
        return logits[0, -1].float().cpu()


def _round_around_leaves(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every floating tensor entering or leaving a leaf module to ``dtype`` (kept in the
    model's own dtype): the precision a ``dtype`` model holds between its kernels."""

    def rounded(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype).to(value.dtype)
        if isinstance(value, tuple):
            return tuple(rounded(item) for item in value)
        return value

    def before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return rounded(args), {name: rounded(value) for name, value in kwargs.items()}

    def after(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return rounded(output)

    for module in model.modules():
        if next(module.children(), None) is None:
            module.register_forward_pre_hook(before, with_kwargs=True)
            module.register_forward_hook(after)
