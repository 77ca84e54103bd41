"""Differences between the transformers versions we support (>= 5.17).

transformers 5.24 renamed the forward keyword ``past_key_values`` to ``cache``; 5.17 (the
GPU machines) and 5.19 (SGLang's pin) only know the old name. We read the model's own
signature instead of comparing version strings.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["cache_kwarg", "last_logits_only", "output_cache"]


def cache_kwarg(model: Any) -> str:
    """The forward keyword that takes a KV cache for this model: ``"cache"`` or ``"past_key_values"``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output: Any) -> Any:
    """The cache a forward returned, under either generation's attribute name."""
    cache = output.get("cache") if hasattr(output, "get") else None
    return cache if cache is not None else output.past_key_values


def last_logits_only(model: Any) -> dict[str, Any]:
    """Forward keywords that make the LM head run on the last token alone (``logits_to_keep=1``
    where the model takes it): a re-prefill read for its next token need not pay the head over
    every position (262k vocabulary entries per token on Gemma 3)."""
    params = inspect.signature(model.forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}
