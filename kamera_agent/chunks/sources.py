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

__all__ = [
    "IMAGE_SUFFIXES",
    "MAX_IMAGE_PIXELS",
    "VIDEO_SUFFIXES",
    "ChannelOrder",
    "Text",
    "VideoFrame",
    "document_pages",
    "looks_like_media_path",
    "read_video",
    "to_rgb_image",
]

ChannelOrder = Literal["rgb", "bgr"]
ImageLike = Image.Image | np.ndarray | str | Path


MAX_IMAGE_PIXELS = 50_000_000
"""Images larger than this (width × height) are refused before they are decoded: a small file
can claim a huge size (a decompression bomb), and a real one this large is never what an agent
means to send (resize it). `WindowConfig.max_image_pixels` sets it per window."""
_CHANNEL_ORDERS = ("rgb", "bgr")

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
"""File suffixes read as images (a GIF gives its first frame; a TIFF its first page here, every
page through `document_pages`)."""
VIDEO_SUFFIXES = frozenset({".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg", ".wmv", ".flv"})
"""File suffixes of videos: they are sampled into frames by `read_video`, never read as one image."""


@dataclass(frozen=True)
class Text:
    """Text to push as text even where it looks like a file path (``Text("diagram.png")``).

    Why a wrapper: a bare ``str`` such as ``"screenshot.png"`` is far more often a path the caller
    meant as an image than a sentence, so it is refused (see `looks_like_media_path`); wrapping it
    says which was meant.
    """

    text: str


def looks_like_media_path(text: str) -> bool:
    """Whether a ``str`` reads as an image or video file name: no whitespace, a media suffix."""
    if not text or any(char.isspace() for char in text):
        return False
    suffix = Path(text).suffix.lower()
    return suffix in IMAGE_SUFFIXES or suffix in VIDEO_SUFFIXES


def to_rgb_image(
    item: ImageLike, channel_order: ChannelOrder | None = None, max_pixels: int = MAX_IMAGE_PIXELS
) -> Image.Image:
    """An RGB PIL image, read as the models' own processors read images.

    - PIL images and files: any mode; transparency (RGBA, LA, palette with alpha) is composited
      on white, as transformers' ``convert_to_rgb`` does, rather than dropped.
    - Arrays ``[H, W]``, ``[H, W, 3]`` or ``[H, W, 4]`` with ``channel_order``: ``uint8`` as is;
      ``uint16`` scaled from 0..65535; other integers must lie in 0..255; floats in 0..1 (scaled)
      or 0..255; a 4th channel is alpha (composited on white).

    Raises:
        AmbiguousChannelOrderError: a 3- or 4-channel array given without ``channel_order``.
        UnreadableInputError: a path that does not exist or is not an image; an empty image; one
            over ``max_pixels``; an array of a non-image dtype (bool, complex, object, text),
            with NaN or infinity, or with values outside its dtype's image range; an unknown
            ``channel_order``.
    """
    if channel_order is not None and channel_order not in _CHANNEL_ORDERS:
        raise UnreadableInputError(f"channel_order must be 'rgb' or 'bgr', got {channel_order!r}")
    if isinstance(item, Image.Image):
        _check_size(item.size, max_pixels)
        return _to_rgb(item)
    if isinstance(item, str | Path):
        return _open_image(Path(item), max_pixels)
    if isinstance(item, np.ndarray):
        _check_size((item.shape[1] if item.ndim > 1 else 0, item.shape[0]), max_pixels)
        return _array_to_image(item, channel_order)
    raise UnreadableInputError(
        f"cannot read an image from {type(item).__name__}; pass a PIL image, an [H, W, 3] uint8 array "
        "with channel_order='rgb' or 'bgr', or a path to an image file"
    )


def _check_size(size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise UnreadableInputError(f"the image is {width}x{height}: it has no pixels")
    if width * height > max_pixels:
        raise UnreadableInputError(
            f"the image is {width}x{height} ({width * height:,} pixels), over the limit of {max_pixels:,}; "
            "resize it first, or raise WindowConfig.max_image_pixels if it is meant to be this large"
        )


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def _open_image(path: Path, max_pixels: int) -> Image.Image:
    if path.suffix.lower() in VIDEO_SUFFIXES:
        raise UnreadableInputError(
            f"{path} is a video: sample its frames with "
            f"kamera_agent.chunks.read_video({str(path)!r}, fps=...) and push each VideoFrame"
        )
    if not path.is_file():
        raise UnreadableInputError(f"no image file at {path}; check the path")
    try:
        with Image.open(path) as image:  # reads the header only: the size is checked before decoding
            _check_size(image.size, max_pixels)
            return _in_memory(_to_rgb(image), image)
    except Image.DecompressionBombError as exc:  # PIL's own, far larger, limit
        raise UnreadableInputError(
            f"{path} claims more pixels than any image should ({exc}): it is over the limit of "
            f"{max_pixels:,}; resize it first"
        ) from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise UnreadableInputError(
            f"{path} is not a readable image ({exc}); convert it to PNG or JPEG"
        ) from exc


def _in_memory(image: Image.Image, opened: Image.Image) -> Image.Image:
    """``image`` decoded into memory, so it outlives the file ``opened`` was read from.

    Why: PIL decodes lazily and closing the file invalidates an image still backed by it; an
    RGB file converts to itself, so it must be copied (a converted one is already a new image).
    """
    return image.copy() if image is opened else image


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
    pixels = _as_uint8(array)
    rgb = pixels[:, :, :3]
    if channel_order == "bgr":
        rgb = rgb[:, :, ::-1]
    image = Image.fromarray(np.ascontiguousarray(rgb), mode="RGB")
    if pixels.shape[2] == 4:
        image = _to_rgb(Image.merge("RGBA", (*image.split(), Image.fromarray(pixels[:, :, 3], mode="L"))))
    return image


def _as_uint8(array: np.ndarray) -> np.ndarray:
    """8-bit pixels from an array of an image dtype, or `UnreadableInputError`."""
    kind = array.dtype.kind
    if array.dtype == np.uint8:
        return array
    if kind not in "uif":
        raise UnreadableInputError(
            f"an array of dtype {array.dtype} is not an image; pass uint8 (0..255), uint16 (0..65535) "
            "or floats (0..1 or 0..255)"
        )
    if kind == "f" and not np.isfinite(array).all():
        raise UnreadableInputError("the image array holds NaN or infinity; clean it first")
    if array.dtype == np.uint16:
        scaled: np.ndarray = (array.astype(np.float32) / 257.0).round().astype(np.uint8)
        return scaled
    low, high = float(array.min()), float(array.max())
    if kind == "f" and low >= 0.0 and high <= 1.0:
        unit: np.ndarray = (array.astype(np.float32) * 255.0).round().astype(np.uint8)
        return unit
    if low < 0 or high > 255:
        raise UnreadableInputError(
            f"image array values lie in {low:g}..{high:g}, outside 0..255 (floats: 0..1 or 0..255); "
            "scale them first"
        )
    return array.round().astype(np.uint8) if kind == "f" else array.astype(np.uint8)


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
        raise UnreadableInputError("pass stride or fps, not both")
    if (stride is not None and stride < 1) or (fps is not None and not fps > 0):
        raise UnreadableInputError(f"stride must be >= 1 and fps > 0; got stride={stride}, fps={fps}")
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
                _check_size(image.size, MAX_IMAGE_PIXELS)
                pages = [_in_memory(_to_rgb(frame), frame) for frame in ImageSequence.Iterator(image)]
        except Image.DecompressionBombError as exc:
            raise UnreadableInputError(f"{path} claims more pixels than any page should ({exc})") from exc
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            raise UnreadableInputError(
                f"{path} is not a readable multi-page image ({exc}); render PDF pages to images first"
            ) from exc
    else:
        pages = [to_rgb_image(page, channel_order) for page in document]
    if not pages:
        raise UnreadableInputError("the document has no pages")
    return pages
