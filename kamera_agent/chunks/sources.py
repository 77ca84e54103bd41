"""Turning what an agent holds into RGB images: PIL images, arrays, files, videos, documents.

Why strict: a BGR frame read by OpenCV and fed as RGB silently swaps red and blue, and the
model answers about the wrong colours. Arrays therefore need an explicit channel order;
video frames read here are converted from OpenCV's BGR once, by us.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageSequence, UnidentifiedImageError

from kamera_agent.errors import AmbiguousChannelOrderError, EmptyVideoError, UnreadableInputError

__all__ = ["ChannelOrder", "VideoFrame", "document_pages", "read_video", "to_rgb_image"]

ChannelOrder = Literal["rgb", "bgr"]
ImageLike = Image.Image | np.ndarray | str | Path


def to_rgb_image(item: ImageLike, channel_order: ChannelOrder | None = None) -> Image.Image:
    """An RGB PIL image from a PIL image, an ``[H, W, 3]`` uint8 array or an image file path.

    Raises:
        AmbiguousChannelOrderError: a 3-channel array given without ``channel_order``.
        UnreadableInputError: a path that does not exist or is not an image.
    """
    if isinstance(item, Image.Image):
        return item.convert("RGB") if item.mode != "RGB" else item
    if isinstance(item, str | Path):
        return _open_image(Path(item))
    if isinstance(item, np.ndarray):
        return _array_to_image(item, channel_order)
    raise UnreadableInputError(
        f"cannot read an image from {type(item).__name__}; pass a PIL image, an [H, W, 3] uint8 array "
        "with channel_order='rgb' or 'bgr', or a path to an image file"
    )


def _open_image(path: Path) -> Image.Image:
    if not path.is_file():
        raise UnreadableInputError(f"no image file at {path}; check the path")
    try:
        with Image.open(path) as image:
            rgb: Image.Image = image.convert("RGB")
            return rgb
    except (UnidentifiedImageError, OSError) as exc:
        raise UnreadableInputError(
            f"{path} is not a readable image ({exc}); convert it to PNG or JPEG"
        ) from exc


def _array_to_image(array: np.ndarray, channel_order: ChannelOrder | None) -> Image.Image:
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    elif array.ndim != 3 or array.shape[2] not in (3, 4):
        raise UnreadableInputError(f"image arrays must be [H, W], [H, W, 3] or [H, W, 4]; got {array.shape}")
    elif channel_order is None:
        raise AmbiguousChannelOrderError(
            f"an array of shape {array.shape} could be RGB or BGR (OpenCV's order) and kamera-agent never "
            "guesses; pass channel_order='rgb' or channel_order='bgr'"
        )
    if array.dtype != np.uint8:
        if np.issubdtype(array.dtype, np.floating) and array.size and float(np.nanmax(array)) <= 1.0:
            array = array * 255.0
        array = np.clip(array, 0, 255).astype(np.uint8)
    rgb = array[:, :, :3]
    if channel_order == "bgr":
        rgb = rgb[:, :, ::-1]
    return Image.fromarray(np.ascontiguousarray(rgb), mode="RGB")


@dataclass(frozen=True)
class VideoFrame:
    """One sampled frame: the image, its index in the stream and its time in seconds."""

    image: Image.Image
    index: int
    seconds: float


def read_video(
    source: str | Path | int,
    *,
    stride: int | None = None,
    fps: float | None = None,
    max_frames: int | None = None,
) -> Iterator[VideoFrame]:
    """Sample frames from a video file or stream with OpenCV, by stride or by target fps.

    Args:
        source: a file path, a stream URL OpenCV understands, or a camera index.
        stride: keep every ``stride``-th frame (default 1 when ``fps`` is not given).
        fps: keep frames at about this rate, from the stream's own frame rate.
        max_frames: stop after this many sampled frames.

    Raises:
        UnreadableInputError: OpenCV cannot open the source.
        EmptyVideoError: the source opened but yielded no frame.
    """
    import cv2

    if stride is not None and fps is not None:
        raise ValueError("pass stride or fps, not both")
    if (stride is not None and stride < 1) or (fps is not None and fps <= 0):
        raise ValueError("stride must be >= 1 and fps > 0")
    is_stream = isinstance(source, int) or str(source).startswith(("rtsp:", "http:", "https:"))
    if not is_stream and not Path(str(source)).exists():
        raise UnreadableInputError(f"no video at {source}; check the path")
    capture = cv2.VideoCapture(str(source) if isinstance(source, Path) else source)
    if not capture.isOpened():
        raise UnreadableInputError(
            f"OpenCV cannot open {source!r}; is it a video file or stream it can decode?"
        )
    native_fps = capture.get(cv2.CAP_PROP_FPS) or 0.0
    step = stride or (max(1, round(native_fps / fps)) if fps and native_fps > 0 else 1)
    yielded = index = 0
    try:
        while max_frames is None or yielded < max_frames:
            ok, frame = capture.read()
            if not ok:
                break
            if index % step == 0:
                seconds = index / native_fps if native_fps > 0 else float(index)
                yield VideoFrame(_array_to_image(frame, "bgr"), index, seconds)
                yielded += 1
            index += 1
    finally:
        capture.release()
    if yielded == 0:
        raise EmptyVideoError(f"{source!r} yielded no frames; is the file empty or truncated?")


def document_pages(
    document: str | Path | Sequence[ImageLike], channel_order: ChannelOrder | None = None
) -> list[Image.Image]:
    """Pages of a document as RGB images: a multi-page image file (TIFF, GIF) or a list of pages.

    ``channel_order`` applies to pages given as arrays (see `to_rgb_image`).

    Raises:
        UnreadableInputError: the file cannot be read, or the document has no page.
    """
    if isinstance(document, str | Path):
        path = Path(document)
        if not path.is_file():
            raise UnreadableInputError(f"no document at {path}; check the path")
        try:
            with Image.open(path) as image:
                pages = [frame.convert("RGB") for frame in ImageSequence.Iterator(image)]
        except (UnidentifiedImageError, OSError) as exc:
            raise UnreadableInputError(
                f"{path} is not a readable multi-page image ({exc}); render PDF pages to images first"
            ) from exc
    else:
        pages = [to_rgb_image(page, channel_order) for page in document]
    if not pages:
        raise UnreadableInputError("the document has no pages")
    return pages
