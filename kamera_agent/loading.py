"""Loading a backend from a local checkpoint or a loaded model, the way users load models.

Why: ``KameraWindow(model)`` must work whenever the processing pieces can be found. We go
through the normal ``from_pretrained`` path: a full ``AutoProcessor`` where it can be built,
else the tokenizer and image processor on their own (without torchvision, transformers cannot
build the Qwen-VL processors, but their image processors load and work).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.errors import CheckpointError, SettingsError, UnsupportedModelError
from kamera_agent.fingerprint import checkpoint_fingerprint

__all__ = ["load_backend", "load_model", "load_processing"]


def load_backend(
    model: Any,
    processor: Any | None = None,
    *,
    tokenizer: Any | None = None,
    image_processor: Any | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> TransformersBackend:
    """A `TransformersBackend` for a loaded model or a local checkpoint directory.

    Missing processing pieces are loaded from the checkpoint directory (or, for a loaded model,
    from its ``name_or_path`` when that is a local directory). A model loaded here from a folder
    is fingerprinted by that folder and dtype (`checkpoint_fingerprint`), as the SGLang and vLLM
    adapters fingerprint what they serve, so windows and engines on one store share entries; a
    model passed loaded is fingerprinted by its weights (it may have changed since loading).

    Raises:
        UnsupportedModelError: the tokenizer cannot be found; the message says what to pass.
    """
    source: str | None
    fingerprint: str | None = None
    if isinstance(model, str | Path):
        source = str(model)
        model = load_model(source, dtype=dtype, device=device)
        fingerprint = checkpoint_fingerprint(source, model.dtype)  # as the engines' adapters name it
    else:
        source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if processor is None and tokenizer is None:
        if not source or not Path(source).is_dir():
            raise UnsupportedModelError(
                "cannot find the tokenizer/processor for this model: pass processor=, or tokenizer= and "
                "image_processor=, or load the model from a local checkpoint directory that holds them"
            )
        processor, tokenizer, image_processor = load_processing(source, needs_images=_is_vlm(model))
    return TransformersBackend(
        model, processor, tokenizer=tokenizer, image_processor=image_processor, fingerprint=fingerprint
    )


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


def load_model(
    path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> Any:
    """``from_pretrained`` a causal LM or an image-text-to-text model from a local directory.

    Raises:
        CheckpointError: no such directory, or one without a model config (machines here never
            download: a hub id is not a checkpoint).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(
            f"no checkpoint folder at {folder}; pass a local directory holding config.json and the weights "
            "(kamera never downloads models), or a loaded model"
        )
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} holds no config.json: it is not a Hugging Face checkpoint folder")
    check_device(device)
    config = AutoConfig.from_pretrained(path)
    auto = (
        AutoModelForImageTextToText
        if getattr(config, "vision_config", None) is not None
        else AutoModelForCausalLM
    )
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = auto.from_pretrained(path, **kwargs)
    if device is not None:
        model = model.to(torch.device(device))  # type: ignore[arg-type]  # transformers' stub types .to oddly
    return model.eval()


def load_processing(path: str | Path, *, needs_images: bool) -> tuple[Any | None, Any, Any | None]:
    """(processor, tokenizer, image_processor) from a checkpoint directory.

    A full processor is used when transformers can build one; otherwise the tokenizer and (for
    VLMs) the image processor are loaded on their own.
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if needs_images:
        try:
            processor = AutoProcessor.from_pretrained(path)
        except (ImportError, OSError, ValueError, TypeError, KeyError):
            processor = None  # e.g. no torchvision for the video processor
        if processor is not None and hasattr(processor, "image_processor"):
            return processor, processor.tokenizer, processor.image_processor
        return None, AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    return None, AutoTokenizer.from_pretrained(path), None


def _is_vlm(model: Any) -> bool:
    return getattr(model.config, "vision_config", None) is not None
