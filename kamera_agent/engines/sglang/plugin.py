"""The ``sglang.srt.plugins`` entry point: registers the ``kamera`` radix-cache backend.

SGLang loads general plugins in every scheduler process (``sglang.srt.plugins.load_plugins``)
and calls each entry point; ``register`` adds kamera's factory to SGLang's radix-cache registry,
so ``--radix-cache-backend kamera`` selects it. Settings come from ``KAMERA_SGLANG_CONFIG``
(a `WindowConfig` as JSON; default: the exact settings, so nothing approximate is served unless
asked for). The factory builds what the cache needs from the server's own description of the
model: the KV layout from its config (no weights loaded), the store from the settings (memory,
``disk_dir``, ``store_url`` or ``KAMERA_STORE_URL``) under the checkpoint's fingerprint, and the
chunking rules from its config and tokenizer.
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
    """Register the backend (idempotent: SGLang may load plugins more than once a process).

    Raises:
        EngineVersionError: an SGLang outside the supported range (`kamera_agent.engines.versions`).
    """
    import sglang

    from kamera_agent.engines.versions import check_engine_version

    check_engine_version("sglang", sglang.__version__)
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, _factory)


def settings() -> WindowConfig:
    """The plugin's `WindowConfig`: ``$KAMERA_SGLANG_CONFIG`` (JSON fields), else `WindowConfig.exact`."""
    text = os.environ.get(CONFIG_VARIABLE)
    return WindowConfig.exact() if not text else WindowConfig(**json.loads(text))


def _factory(ctx: Any) -> Any:
    from kamera_agent.backends.transformers.reading import kv_layout_of_config
    from kamera_agent.engines.sglang.radix import KameraRadixCache
    from kamera_agent.engines.sglang.segments import ChunkRules
    from kamera_agent.engines.stores import STORES
    from kamera_agent.fingerprint import checkpoint_fingerprint

    config = settings()
    server = ctx.server_args
    hf_config = ctx.model_config.hf_config if ctx.model_config is not None else _hf_config(server.model_path)
    tokenizer = _tokenizer(server.tokenizer_path or server.model_path)
    dtype = getattr(ctx.model_config, "dtype", None) or server.dtype  # the served dtype, not "auto"
    fingerprint = checkpoint_fingerprint(server.model_path, dtype)
    layout = kv_layout_of_config(hf_config)
    return KameraRadixCache(
        ctx.params,
        config,
        store=STORES.open(fingerprint, config),
        layout=layout,
        rules=ChunkRules.for_model(hf_config, tokenizer),
        pool_pairing=pool_pairing(ctx.tp_worker, hf_config, layout),
    )


def pool_pairing(tp_worker: Any, hf_config: Any, layout: Any) -> Any:
    """How SGLang's rotary pairs the model's rope band: read off the loaded model's rotary module
    where the worker is at hand, else from the config the way SGLang's DeepSeek code decides it
    (``is_neox_style = not rope_interleave``); ``None`` (as the layout pairs it) otherwise."""
    from kamera_agent.engines.sglang.pool import rotary_pairing

    model = getattr(getattr(tp_worker, "model_runner", None), "model", None)
    if model is not None:
        for name, module in model.named_modules():
            language = "visual" not in name and "vision" not in name  # a vision tower's rotary is not it
            if language and hasattr(module, "is_neox_style") and hasattr(module, "rotary_dim"):
                return rotary_pairing(module)
    if layout.kind == "mla":
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        return "half" if not getattr(text, "rope_interleave", True) else "interleaved"
    return None


def _hf_config(path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
