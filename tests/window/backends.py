"""The backends window tests run on: 4-layer models that condition measurably, on both engines.

A 2-layer model hides every bug that flows through a second layer of conditioning (a chunk's KV
then depends only on its antecedents' layer-0 KV, which no patch changes), so every window test
uses 4 decoder layers: tiny random Qwen2 (text) and Qwen2-VL (images) through transformers, and
the plain-torch backend that proves the engine seam.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cache
from typing import Any

from kamera_agent.backends.base import Backend
from kamera_agent.models.real import RealModel
from tests.backends.test_transformers_backend import text_backend, vl_backend


def _tiny_torch() -> Backend:
    from kamera_agent.backends.tiny_torch import TinyTorchBackend

    return TinyTorchBackend(seed=0)


def _real(name: RealModel) -> Backend:
    from kamera_agent.loading import load_backend
    from kamera_agent.models.real import real_model_gguf
    from tests.real_env import ensure_real_models

    ensure_real_models()
    return load_backend(real_model_gguf(name))


BACKENDS: dict[str, Callable[[], Backend]] = {
    "qwen2": lambda: text_backend("qwen2", layers=4),
    "gemma3": lambda: text_backend("gemma3", layers=4),
    "qwen2_vl": lambda: vl_backend("qwen2_vl", layers=4),
    "tiny_torch": _tiny_torch,
    "smollm2": lambda: _real("smollm2"),  # a real model: SmolLM2-135M-Instruct, 30 layers
}


@cache
def backend_named(name: str) -> Backend:
    """One shared instance per name (building a backend computes its fingerprint)."""
    return BACKENDS[name]()


class CountingBackend(Backend):
    """Another backend behind the same seam, counting every primitive call (and able to fail one).

    The seam is small enough to wrap in a few lines: a window over this backend behaves exactly
    like one over the wrapped backend, and a test can assert that a dry run called nothing.
    """

    def __init__(
        self, inner: Backend, fail_prefill_at: int | None = None, *, extend: bool | None = None
    ) -> None:
        self.inner, self.calls = inner, {"prefill": 0, "encode_vision": 0, "assemble": 0, "decode": 0}
        self.fail_prefill_at = fail_prefill_at
        self.layout, self.fingerprint, self.encoder = inner.layout, inner.fingerprint, inner.encoder
        extended = inner.capabilities.extend if extend is None else extend
        self.capabilities = replace(inner.capabilities, extend=extended)
        self.calls["crop"] = 0
        self.assembles: list[tuple[int, bool]] = []
        """Each `assemble` call: how many placed pieces, and whether it appended onto a cache."""

    @property
    def device(self) -> Any:
        return self.inner.device

    @property
    def dtype(self) -> Any:
        return self.inner.dtype

    @property
    def context_limit(self) -> int | None:
        return self.inner.context_limit

    def prefill(
        self, chunks: Any, context: Any, start: int, vision: Any = (), onto: Any = None, **gaps: Any
    ) -> Any:
        self.calls["prefill"] += 1
        if self.fail_prefill_at is not None and self.calls["prefill"] == self.fail_prefill_at:
            raise RuntimeError("the engine failed mid-op")
        return self.inner.prefill(chunks, context, start, vision, onto, **gaps)

    def encode_vision(self, chunk: Any) -> Any:
        self.calls["encode_vision"] += 1
        return self.inner.encode_vision(chunk)

    def assemble(self, placed: Any, onto: Any = None) -> Any:
        self.calls["assemble"] += 1
        self.assembles.append((len(placed), onto is not None))
        return self.inner.assemble(placed, onto)

    def crop(self, cache: Any, slots: int) -> Any:
        self.calls["crop"] += 1
        return self.inner.crop(cache, slots)

    def decode(self, cache: Any, query_ids: Any, start: int, config: Any) -> Any:
        self.calls["decode"] += 1
        return self.inner.decode(cache, query_ids, start, config)

    def reference_prefill(self, chunks: Any, query_ids: Any = None, *, anchor: Any = None) -> Any:
        return self.inner.reference_prefill(chunks, query_ids, anchor=anchor)

    def reference_inputs(self, chunks: Any, query_ids: Any = None, *, anchor: Any = None) -> Any:
        return self.inner.reference_inputs(chunks, query_ids, anchor=anchor)

    def total(self) -> int:
        return sum(self.calls.values())
