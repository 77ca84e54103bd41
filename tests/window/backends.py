"""The backends window tests run on: 4-layer models that condition measurably, on both engines.

A 2-layer model hides every bug that flows through a second layer of conditioning (a chunk's KV
then depends only on its antecedents' layer-0 KV, which no patch changes), so every window test
uses 4 decoder layers: tiny random Qwen2 (text) and Qwen2-VL (images) through transformers, and
the plain-torch backend that proves the engine seam.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

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
