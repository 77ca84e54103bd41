"""Differences between the transformers versions we support (>= 5.17).

transformers 5.24 renamed the forward keyword ``past_key_values`` to ``cache``; 5.17 (the
GPU machines) and 5.19 (SGLang's pin) only know the old name. We read the model's own
signature instead of comparing version strings.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["cache_kwarg", "output_cache"]


def cache_kwarg(model: Any) -> str:
    """The forward keyword that takes a KV cache for this model: ``"cache"`` or ``"past_key_values"``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output: Any) -> Any:
    """The cache a forward returned, under either generation's attribute name."""
    cache = output.get("cache") if hasattr(output, "get") else None
    return cache if cache is not None else output.past_key_values
