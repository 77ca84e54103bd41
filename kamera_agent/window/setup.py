"""Making a window's parts from what a user passes: a backend, a store, chunks from items.

Why here: every setting must either apply or say where to set it. The store belongs to the
window (above the engine), so ``memory_limit`` and ``disk_dir`` apply whatever the model is;
``device`` and ``dtype`` say how to load or cast a model, so they apply to a checkpoint path or a
loaded model and are checked, never silently ignored, against a `Backend` built elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from kamera_agent.backends.base import Backend
from kamera_agent.chunks.chunk import Chunk, ChunkKind
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.chunks.sources import (
    ChannelOrder,
    Text,
    VideoFrame,
    looks_like_media_path,
)
from kamera_agent.config import STORE_FIELDS, WindowConfig
from kamera_agent.errors import InputError, MediaPathAsTextError, SettingsError, UnreadableInputError
from kamera_agent.store import ChunkStore

__all__ = ["Item", "chunk_of", "resolve_backend", "resolve_store"]

Item = Chunk | str | Text | Image.Image | np.ndarray | Path | VideoFrame


def resolve_backend(
    model: Any,
    processor: Any | None,
    tokenizer: Any | None,
    image_processor: Any | None,
    config: WindowConfig,
    *,
    chat_template: str | None = None,
) -> Backend:
    """The backend for ``model`` (a `Backend`, a loaded transformers model, or the path of a
    checkpoint folder or GGUF file); ``chat_template`` replaces the tokenizer's own.

    Raises:
        SettingsError: ``device``/``dtype`` set for a `Backend` that runs elsewhere, or a device
            this torch cannot use.
        CheckpointError: a path that is not a checkpoint folder or GGUF file kamera can load.
    """
    from kamera_agent.loading import check_device, load_backend

    check_device(config.device)
    dtype = getattr(torch, config.dtype) if config.dtype is not None else None
    if isinstance(model, Backend):
        _check_placement(model, config, dtype)
        if chat_template is not None:
            raise SettingsError(
                "chat_template applies to a model kamera loads; set it on the tokenizer of this Backend"
            )
        return model
    if not isinstance(model, str | Path):
        if config.device is not None:
            model = model.to(torch.device(config.device))
        if dtype is not None:
            model = model.to(dtype)
    return load_backend(
        model,
        processor,
        tokenizer=tokenizer,
        image_processor=image_processor,
        dtype=dtype,
        device=config.device,
        chat_template=chat_template,
    )


def resolve_store(backend: Backend, config: WindowConfig, store: ChunkStore | None) -> ChunkStore:
    """``store`` if given (then no store setting may be set too), else one built from the settings
    (the shared tier from ``config.store_url``, else from ``KAMERA_STORE_URL``).

    Raises:
        SettingsError: both a store and store settings.
        StoreURLError: a store URL kamera cannot use.
    """
    if store is None:
        return config.open_store(backend.fingerprint)
    given = sorted(name for name in STORE_FIELDS if name in config.model_fields_set)
    if given:
        raise SettingsError(
            f"{', '.join(given)} configure the store a window builds, but store= was passed too; set "
            "them on that ChunkStore (ChunkStore(memory_limit=..., disk_dir=..., remote=..., "
            "secret=...)) or pass no store"
        )
    return store


def chunk_of(
    encoder: ChunkEncoder,
    item: Item,
    kind: ChunkKind | None,
    caption: str | None,
    channel_order: ChannelOrder | None,
    label: str | None,
    max_pixels: int,
) -> Chunk:
    """The model-ready chunk for a pushed item (the op's ``kind``, ``caption``,
    ``channel_order`` and ``label``; images over ``max_pixels`` refused before decoding).

    Raises:
        InputError: a kind that does not fit the item (or is no kind at all), or content that
            cannot become a chunk (see `ChunkEncoder` and `to_rgb_image`).
    """
    if kind is not None and kind not in _KINDS:
        raise InputError(f"kind={kind!r} is not a chunk kind; use one of {', '.join(_KINDS)}")
    if isinstance(item, Chunk):
        return item
    if isinstance(item, str) and looks_like_media_path(item):
        raise MediaPathAsTextError(
            f"{item!r} looks like a file path, not text: pass Path({item!r}) to push the file "
            f"(a video: kamera_agent.chunks.read_video), or Text({item!r}) to push these characters as text"
        )
    if isinstance(item, Text):
        item = item.text
        if not isinstance(item, str):
            raise InputError(f"Text wraps a str, got {type(item).__name__}")
    if isinstance(item, str):
        if kind not in (None, "text"):
            raise InputError(f"text is pushed with kind='text' (or none), not {kind!r}")
        if caption is not None:
            raise InputError("a caption frames an image; for text, put it in the text")
        return encoder.text(item, label=label)
    if kind == "text":
        raise InputError(f"kind='text' is for text; this is a {type(item).__name__}")
    if isinstance(item, VideoFrame):
        meta = {"frame": str(item.index), "seconds": f"{item.seconds:.3f}"}
        return encoder.image(
            item.image, kind=kind or "frame", caption=caption, label=label, meta=meta, max_pixels=max_pixels
        )
    if isinstance(item, Image.Image | np.ndarray | Path):
        return encoder.image(
            item,
            kind=kind or "image",
            caption=caption,
            channel_order=channel_order,
            label=label,
            max_pixels=max_pixels,
        )
    raise UnreadableInputError(
        f"cannot push a {type(item).__name__}; push a PIL image, an array (with channel_order), "
        "a Path to an image, a VideoFrame, text (str or Text) or a Chunk"
    )


_KINDS = ("image", "frame", "screenshot", "page", "text")


def _check_placement(backend: Backend, config: WindowConfig, dtype: torch.dtype | None) -> None:
    wrong = []
    if config.device is not None and _normal(torch.device(config.device)) != _normal(backend.device):
        wrong.append(f"device={config.device!r} (it runs on {backend.device})")
    if dtype is not None and dtype != backend.dtype:
        wrong.append(f"dtype={config.dtype!r} (it computes in {backend.dtype})")
    if wrong:
        raise SettingsError(
            f"WindowConfig sets {' and '.join(wrong)}, but a Backend was passed: move or cast the model "
            "before building the backend (e.g. TransformersBackend(model.to(device, dtype), ...)), or pass "
            "the model or its checkpoint path to KameraWindow so these settings can apply"
        )


def _normal(device: torch.device) -> torch.device:
    """``cuda`` and ``cuda:0`` name the same device when it is the current one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
