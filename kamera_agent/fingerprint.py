"""Model fingerprints: KV made by one model must never be served to another.

Why: a canonical or patch is only valid for the exact weights, dtype and architecture that
computed it. The fingerprint hashes the architecture and config, the dtype, and a strided
sample of every parameter (hashing all of a 7B model's weights would take seconds; a sample
of each tensor still changes when any tensor is retrained, re-initialised or re-quantised).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["checkpoint_fingerprint", "model_fingerprint"]

_SAMPLES_PER_TENSOR = 64
_SAMPLE_BYTES = 1 << 20


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


def checkpoint_fingerprint(path: str | os.PathLike[str], dtype: torch.dtype | str = "") -> str:
    """A hex digest identifying a checkpoint directory without loading it, for engines that hold
    the weights themselves (SGLang, vLLM) and windows that load it: its config and, per weights
    file, name, size and a sample of its bytes (the first and last MiB: headers name every
    tensor, data ends differ when any tensor was retrained); ``dtype`` is the one the model is
    served in (a ``torch.dtype`` or its name: ``"float32"`` and ``torch.float32`` are one)."""
    root = Path(path)
    digest = hashlib.sha256(f"checkpoint\x1f{_dtype_name(dtype)}".encode())
    config = root / "config.json"
    if config.is_file():
        as_dict = json.loads(config.read_text())
        as_dict.pop("_name_or_path", None)
        as_dict.pop("transformers_version", None)
        digest.update(json.dumps(as_dict, sort_keys=True).encode())
    for weights in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as handle:
            digest.update(handle.read(_SAMPLE_BYTES))
            handle.seek(max(0, size - _SAMPLE_BYTES))
            digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def _dtype_name(dtype: torch.dtype | str) -> str:
    """``"torch.float32"`` for ``torch.float32``, ``"float32"`` and ``"torch.float32"``."""
    if isinstance(dtype, torch.dtype):
        return str(dtype)
    named = getattr(torch, dtype.removeprefix("torch."), None) if dtype else None
    return str(named) if isinstance(named, torch.dtype) else dtype
