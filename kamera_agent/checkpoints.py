"""What a model path names, and the folder transformers loads it from.

Why: users name a model three ways: a Hugging Face folder, a GGUF file (how llama.cpp and many
small models ship), or a model already loaded. transformers reads a GGUF file by dequantizing
every tensor, at every load, and cannot save what it read, so kamera converts
a GGUF file once into a folder in its cache (safetensors, config and the tokenizer the file
carries, keyed by the file's content) and loads that folder from then on: the same weights, bit
for bit, without dequantizing again. Every entry point (windows, ``kamera check``, ``calibrate``,
``bench``, ``serve`` and the engine adapters) resolves a path here, so each refuses the same
paths with the same named error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kamera_agent.errors import CheckpointError, UnsupportedModelError

__all__ = [
    "CACHE_DIR_VARIABLE",
    "SOURCE_FILE",
    "Checkpoint",
    "cache_dir",
    "gguf_folder",
    "is_gguf",
    "load_model",
    "resolve_checkpoint",
    "write_atomically",
]

CACHE_DIR_VARIABLE = "KAMERA_CACHE_DIR"
"""Where kamera stores what it derives from models (converted GGUF files, fingerprints); default
``~/.cache/kamera``."""

_GGUF_MAGIC = b"GGUF"
_WEIGHTS = ("*.safetensors", "*.bin")
SOURCE_FILE = "kamera-source.json"
"""Written last into a converted folder: the GGUF file it came from (a folder without it is an
interrupted conversion, redone)."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A model path resolved.

    Attributes:
        folder: a folder holding ``config.json`` and the weights (for a GGUF file, its converted
            folder in kamera's cache).
        named: the path the user gave.
        gguf: the GGUF file, where one was named (or found alone in the named folder).
    """

    folder: Path
    named: Path
    gguf: Path | None = None


def cache_dir() -> Path:
    """kamera's cache folder: ``$KAMERA_CACHE_DIR``, else ``~/.cache/kamera``."""
    chosen = os.environ.get(CACHE_DIR_VARIABLE)
    return Path(chosen) if chosen else Path.home() / ".cache" / "kamera"


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a GGUF file (by its magic bytes, whatever its name)."""
    try:
        with path.open("rb") as handle:
            return handle.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def resolve_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """The folder to load for ``path``: a Hugging Face folder as it is; a GGUF file (or a folder
    holding one GGUF file and no ``config.json``) converted once into kamera's cache.

    Raises:
        CheckpointError: no such path, a file that is not GGUF, a folder without a config or
            without weights, a folder holding several GGUF files, or a GGUF file transformers
            cannot read (the message says which and what to pass instead).
        UnsupportedModelError: a GGUF file of an architecture transformers cannot load.
    """
    named = Path(path).expanduser()
    if not named.exists():
        raise CheckpointError(
            f"no checkpoint at {named}: pass a local folder holding config.json and the weights, a GGUF "
            "file, or a loaded model (kamera never downloads models)"
        )
    if named.is_file():
        if not is_gguf(named):
            raise CheckpointError(
                f"{named} is a file but not a GGUF file (it does not start with 'GGUF'); pass a GGUF file "
                "or the Hugging Face folder holding config.json and the weights"
            )
        return Checkpoint(gguf_folder(named), named, named)
    if (named / "config.json").is_file():
        if not any(found for pattern in _WEIGHTS for found in named.glob(pattern)):
            raise CheckpointError(
                f"{named} holds config.json but no weights (*.safetensors or *.bin): copy the weights "
                "next to it, or pass the GGUF file the model ships as"
            )
        return Checkpoint(named, named)
    ggufs = sorted(p for p in named.iterdir() if p.suffix == ".gguf" and p.is_file())
    if len(ggufs) == 1:
        return Checkpoint(gguf_folder(ggufs[0]), named, ggufs[0])
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise CheckpointError(f"{named} holds several GGUF files ({names}); pass the one to load")
    raise CheckpointError(
        f"{named} holds no config.json and no GGUF file: it is not a model folder; pass a Hugging Face "
        "folder (config.json and weights) or a GGUF file"
    )


def gguf_folder(gguf: Path) -> Path:
    """The converted folder of a GGUF file, made on first use (safetensors at the precision
    transformers dequantizes to, the config, and the tokenizer where the file carries one).

    Several processes may convert one file at once: each writes a folder of its own and the
    first to finish is kept.

    Raises:
        CheckpointError: ``gguf`` and ``accelerate`` are not installed, or the file is unreadable.
        UnsupportedModelError: transformers cannot load this architecture from GGUF.
    """
    _need_gguf_packages()
    digest = _content_digest(gguf)
    folder = cache_dir() / "gguf" / digest[:32]
    if (folder / SOURCE_FILE).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    _log.warning("kamera: converting %s into %s (once per file)", gguf, folder)
    scratch = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        _convert(gguf, scratch, digest)
        try:
            scratch.rename(folder)
        except OSError:  # another process finished first (or an interrupted one left a folder)
            if not (folder / SOURCE_FILE).is_file():
                shutil.rmtree(folder, ignore_errors=True)
                scratch.rename(folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Any:
    """``from_pretrained`` a causal LM or an image-text-to-text model from a local folder or a
    GGUF file (see `resolve_checkpoint`).

    Raises:
        CheckpointError: the path cannot be loaded (see `resolve_checkpoint`).
        UnsupportedModelError: transformers has no causal LM for this checkpoint's architecture.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    folder = resolve_checkpoint(path).folder
    config = AutoConfig.from_pretrained(folder)
    auto = (
        AutoModelForImageTextToText
        if getattr(config, "vision_config", None) is not None
        else AutoModelForCausalLM
    )
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        model = auto.from_pretrained(folder, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise UnsupportedModelError(
            f"{path}: model type {getattr(config, 'model_type', '?')!r} has no causal language model in "
            "transformers; kamera serves decoder LMs with rotary positions"
        ) from exc
    if device is not None:
        model = model.to(torch.device(device))  # type: ignore[arg-type]  # transformers' stub types .to oddly
    return model.eval()


def _need_gguf_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise CheckpointError(
            f"reading a GGUF file needs the {' and '.join(missing)} package(s): pip install "
            "'kamera-agent[gguf]' (or pip install gguf accelerate)"
        )


def _content_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, remembered by path, size and modification time (a GGUF
    file is read whole once, not at every load)."""
    stat = path.stat()
    index = cache_dir() / "gguf" / "digests"
    name = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    memo = index / name[:32]
    if memo.is_file():
        return memo.read_text().strip()
    digest = hashlib.sha256()
    try:
        with path.open("rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    value = digest.hexdigest()
    write_atomically(memo, value)
    return value


def _convert(gguf: Path, folder: Path, digest: str) -> None:
    """Dequantize ``gguf`` with transformers' own GGUF reader and save it as a folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf.parent), gguf.name
    try:
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        if "not supported" in str(exc) or isinstance(exc, KeyError | NotImplementedError):
            raise UnsupportedModelError(
                f"{gguf}: transformers cannot load this GGUF file's architecture ({exc}); convert the model "
                "to a Hugging Face folder with its own tools and pass that folder"
            ) from exc
        raise CheckpointError(f"{gguf}: transformers cannot read this GGUF file ({exc})") from exc
    # What transformers read is plain dequantized tensors; its GGUF marker only blocks saving them.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    model.save_pretrained(folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except (ValueError, KeyError, OSError) as exc:  # no tokenizer metadata in the file
        _log.warning("kamera: %s carries no tokenizer kamera can read (%s)", gguf, exc)
    else:
        tokenizer.save_pretrained(folder)
    import transformers

    source = {"gguf": name, "sha256": digest, "transformers": transformers.__version__}
    (folder / SOURCE_FILE).write_text(json.dumps(source, indent=2))


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers in other
    processes see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".writing-", dir=path.parent)
    with os.fdopen(handle, "w") as out:
        out.write(text)
    os.replace(temporary, path)
