"""Model fingerprints: KV made by one model must never be served to another.

Why: a canonical or patch is only valid for the exact weights, dtype and architecture that
computed it. The fingerprint hashes the architecture and config, the dtype, and a strided
sample of every parameter (hashing all of a 7B model's weights would take seconds; a sample
of each tensor still changes when any tensor is retrained, re-initialised or re-quantised).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

__all__ = ["model_fingerprint"]

_SAMPLES_PER_TENSOR = 64


def model_fingerprint(model: Any) -> str:
    """A hex digest identifying the model's architecture, config, dtype and weights."""
    digest = hashlib.sha256()
    digest.update(type(model).__name__.encode())
    config = getattr(model, "config", None)
    if config is not None:
        as_dict = config.to_diff_dict() if hasattr(config, "to_diff_dict") else dict(vars(config))
        as_dict.pop("_name_or_path", None)
        as_dict.pop("transformers_version", None)
        digest.update(json.dumps(as_dict, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::step][:_SAMPLES_PER_TENSOR].to("cpu", torch.float64)
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()
