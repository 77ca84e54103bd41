"""Loading a backend from what users have: a checkpoint folder, a GGUF file or a loaded model.

Why: ``KameraWindow(model)`` must work whenever the processing pieces can be found. We go
through the normal ``from_pretrained`` path (a GGUF file through its converted folder, see
`kamera_agent.checkpoints`): a full ``AutoProcessor`` where it can be built, else the tokenizer
and image processor on their own (without torchvision, transformers cannot build the Qwen-VL
processors, but their image processors load and work). A loaded model's pieces are found where it
came from: the folder it was loaded from, or the GGUF file transformers read it from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.checkpoints import SOURCE_FILE, gguf_folder, is_gguf, load_model, resolve_checkpoint
from kamera_agent.errors import SettingsError, TokenizerNotFoundError

__all__ = ["load_backend", "load_model", "load_processing", "model_origin"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_backend(
    model: Any,
    processor: Any | None = None,
    *,
    tokenizer: Any | None = None,
    image_processor: Any | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    chat_template: str | None = None,
) -> TransformersBackend:
    """A `TransformersBackend` for a loaded model, a checkpoint folder or a GGUF file.

    Missing processing pieces are loaded from where the model came from (`model_origin`);
    ``chat_template`` (Jinja text) replaces the tokenizer's own, or gives a base model one. Every
    way of naming one model gives one fingerprint (`kamera_agent.model_fingerprint` hashes the
    weights, not their origin), the one SGLang's and vLLM's adapters name their store by.

    Raises:
        CheckpointError: a path that is not a folder or GGUF file kamera can load.
        TokenizerNotFoundError: no tokenizer passed, and none where the model came from.
    """
    origin: Path | None
    if isinstance(model, str | Path):
        check_device(device)
        folder = resolve_checkpoint(model).folder
        model, origin = load_model(folder, dtype=dtype, device=device), folder
    else:
        origin = model_origin(model)
    if processor is None and tokenizer is None:
        if origin is None:
            raise TokenizerNotFoundError(
                "cannot find the tokenizer/processor for this model: pass processor=, or tokenizer= and "
                "image_processor=, or pass the model's checkpoint folder or GGUF file instead of the "
                "loaded model"
            )
        processor, tokenizer, image_processor = load_processing(origin, needs_images=_is_vlm(model))
    if chat_template is not None:
        for holder in (processor, tokenizer, getattr(processor, "tokenizer", None)):
            if holder is not None:
                holder.chat_template = chat_template
    return TransformersBackend(model, processor, tokenizer=tokenizer, image_processor=image_processor)


def model_origin(model: Any) -> Path | None:
    """The folder a loaded model's processing pieces load from: the checkpoint folder it was
    loaded from, or the converted folder of the GGUF file transformers read it from; ``None``
    where neither is known (a model built in memory)."""
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not source or not Path(source).exists():
        return None
    where = Path(source)
    named = _gguf_file(model)
    if named and (where / named).is_file():
        return gguf_folder(where / named)
    if where.is_file():
        return gguf_folder(where) if is_gguf(where) else None
    if any((where / name).is_file() for name in ("config.json", *_TOKENIZER_FILES)):
        return where
    ggufs = [p for p in where.glob("*.gguf") if is_gguf(p)]
    return gguf_folder(ggufs[0]) if len(ggufs) == 1 else None


def check_device(device: str | torch.device | None) -> None:
    """Refuse a device this torch cannot use, with the reason (torch asserts instead).

    Raises:
        SettingsError: an unknown device name, or CUDA/MPS that this torch build or machine lacks.
    """
    if device is None:
        return
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise SettingsError(
            f"device={device!r} is not a torch device ({exc}); use 'cpu', 'cuda' or 'cuda:N'"
        ) from exc
    if where.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "CUDA, but no GPU is visible"
            raise SettingsError(
                f"device={device!r}: this torch ({torch.__version__}) is {build}; use device='cpu'"
            )
        if where.index is not None and where.index >= torch.cuda.device_count():
            raise SettingsError(
                f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    elif where.type == "mps" and not torch.backends.mps.is_available():
        raise SettingsError(f"device={device!r}: MPS is not available here; use device='cpu'")


def load_processing(path: str | Path, *, needs_images: bool) -> tuple[Any | None, Any, Any | None]:
    """(processor, tokenizer, image_processor) from a checkpoint directory.

    A full processor is used when transformers can build one; otherwise the tokenizer and (for
    VLMs) the image processor are loaded on their own.
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        raise TokenizerNotFoundError(
            f"{path} holds no tokenizer ({', '.join(_TOKENIZER_FILES)}); pass tokenizer= (and "
            "image_processor= for a vision model) with the model"
            + (" — the GGUF file it was converted from carries none" if _converted(path) else "")
        )
    if needs_images:
        try:
            processor = AutoProcessor.from_pretrained(path)
        except (ImportError, OSError, ValueError, TypeError, KeyError):
            processor = None  # e.g. no torchvision for the video processor
        if processor is not None and hasattr(processor, "image_processor"):
            return processor, processor.tokenizer, processor.image_processor
        return None, AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    return None, AutoTokenizer.from_pretrained(path), None


def _gguf_file(model: Any) -> str | None:
    """The GGUF file name transformers records on a model it read from one."""
    quantization = getattr(model.config, "quantization_config", None)
    if isinstance(quantization, dict):
        name = quantization.get("gguf_file")
    else:
        name = getattr(quantization, "gguf_file", None)
    return name if isinstance(name, str) else None


def _converted(path: str | Path) -> bool:
    return (Path(path) / SOURCE_FILE).is_file()


def _is_vlm(model: Any) -> bool:
    return getattr(model.config, "vision_config", None) is not None
