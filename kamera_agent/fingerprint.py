"""Model fingerprints: KV made by one model must never be served to another.

Why: a canonical or patch is only valid for the exact weights, dtype and architecture that
computed it. The fingerprint hashes the model class, the config fields that shape its forward,
and per parameter its name, shape, dtype and a strided sample of its values (hashing all of a 7B
model's weights would take seconds; a sample of each tensor still changes when any tensor is
retrained, re-initialised or re-quantised).

One model has one fingerprint however it arrives: loaded from a GGUF file, from the folder it
was converted to, or passed in loaded, the values are the same, and where it came from (its path,
the GGUF marker, the transformers version, the attention kernel) is left out. So calibrations and
store entries follow the weights, and an engine that holds the weights itself (SGLang, vLLM) names
its checkpoint by the same digest (`checkpoint_fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from kamera_agent.checkpoints import cache_dir, load_model, resolve_checkpoint, write_atomically
from kamera_agent.errors import SettingsError

__all__ = ["checkpoint_fingerprint", "model_fingerprint"]

_SCHEME = b"kamera-fingerprint-2"
_SAMPLES_PER_TENSOR = 64
_ORIGIN_FIELDS = frozenset(
    {
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
        "quantization_config",
        "dtype",
        "torch_dtype",
        "_commit_hash",
        "architectures",
        "attn_implementation",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "use_cache",
    }
)
"""Config fields that say where a model came from or how it runs, not what it computes (the
dtype is hashed per parameter)."""


def model_fingerprint(model: Any) -> str:
    """A hex digest of the model's architecture, forward-shaping config, dtype and weights."""
    digest = hashlib.sha256(_SCHEME)
    digest.update(type(model).__name__.encode())
    config = getattr(model, "config", None)
    if config is not None:
        as_dict = config.to_diff_dict() if hasattr(config, "to_diff_dict") else dict(vars(config))
        digest.update(json.dumps(_forward_fields(as_dict), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::step][:_SAMPLES_PER_TENSOR].to("cpu", torch.float64)
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def checkpoint_fingerprint(path: str | os.PathLike[str], dtype: torch.dtype | str = "") -> str:
    """`model_fingerprint` of the model at ``path`` (a folder or a GGUF file) loaded in
    ``dtype`` (a ``torch.dtype`` or its name; ``""`` or ``"auto"``: as stored), for engines that
    hold the weights themselves and name their store by it.

    The first call for a checkpoint loads it on the CPU once; the digest is then remembered in
    kamera's cache by the files' paths, sizes and modification times.

    Raises:
        CheckpointError: the path cannot be loaded (see `kamera_agent.checkpoints.resolve_checkpoint`).
    """
    checkpoint = resolve_checkpoint(path)
    wanted = _dtype(dtype)
    memo = cache_dir() / "fingerprints" / _files_key(checkpoint.folder, wanted)
    if memo.is_file():
        return memo.read_text().strip()
    value = model_fingerprint(load_model(checkpoint.folder, dtype=wanted))
    write_atomically(memo, value)
    return value


def _forward_fields(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without `_ORIGIN_FIELDS`, at every depth (a VLM's text and vision configs)."""
    return {
        key: _forward_fields(value) if isinstance(value, dict) else value
        for key, value in config.items()
        if key not in _ORIGIN_FIELDS
    }


def _files_key(folder: Path, dtype: torch.dtype | None) -> str:
    """A name for what ``folder`` holds now: its path, and each config and weights file's name,
    size and modification time (a rewritten file is a new key)."""
    digest = hashlib.sha256(_SCHEME + f"|{folder.resolve()}|{dtype}".encode())
    for file in sorted(folder.iterdir()):
        if file.suffix in (".json", ".safetensors", ".bin") and file.is_file():
            stat = file.stat()
            digest.update(f"|{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:40]


def _dtype(dtype: torch.dtype | str) -> torch.dtype | None:
    """``torch.float32`` for ``torch.float32``, ``"float32"`` and ``"torch.float32"``; ``None``
    (as stored) for ``""`` and ``"auto"``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if not dtype or dtype == "auto":
        return None
    named = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(named, torch.dtype):
        raise SettingsError(f"dtype {dtype!r} is not a torch dtype; use e.g. 'float32' or 'bfloat16'")
    return named
