"""The ``sglang.srt.plugins`` entry point: registers the ``kamera`` radix-cache backend.

SGLang loads general plugins in every scheduler process (``sglang.srt.plugins.load_plugins``)
and calls each entry point; ``register`` adds kamera's factory to SGLang's radix-cache registry,
so ``--radix-cache-backend kamera`` selects it. Settings come from ``KAMERA_SGLANG_CONFIG``
(a `WindowConfig` as JSON; default: the exact settings, so nothing approximate is served unless
asked for).
"""

from __future__ import annotations

import json
import os
from typing import Any

from kamera_agent.config import WindowConfig

__all__ = ["BACKEND_NAME", "CONFIG_VARIABLE", "register", "settings"]

BACKEND_NAME = "kamera"
CONFIG_VARIABLE = "KAMERA_SGLANG_CONFIG"


def register() -> None:
    """Register the backend (idempotent: SGLang may load plugins more than once a process)."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, _factory)


def settings() -> WindowConfig:
    """The plugin's `WindowConfig`: ``$KAMERA_SGLANG_CONFIG`` (JSON fields), else `WindowConfig.exact`."""
    text = os.environ.get(CONFIG_VARIABLE)
    return WindowConfig.exact() if not text else WindowConfig(**json.loads(text))


def _factory(ctx: Any) -> Any:
    from kamera_agent.backends.sglang.radix import KameraRadixCache

    return KameraRadixCache(ctx.params, settings())
