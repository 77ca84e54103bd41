"""Chunk sources (arrays, files, videos, documents) and the encoder's keys and errors."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from kamera_agent.chunks import document_pages, read_video, to_rgb_image
from kamera_agent.errors import (
    AmbiguousChannelOrderError,
    EmptyVideoError,
    ForeignChunkError,
    ProcessorRejectedError,
    UnreadableInputError,
    UnsupportedModelError,
)
from kamera_agent.window import KameraWindow
from tests.backends.test_transformers_backend import text_backend, vl_backend


def _write_video(path: Path, frames: int, size: int = 56) -> list[np.ndarray]:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (size, size))
    written = []
    for i in range(frames):
        frame = np.zeros((size, size, 3), dtype=np.uint8)
        frame[:, :, 0] = 200  # blue in OpenCV's BGR order
        frame[: (i + 1) * 4, :, 2] = 255  # a red band growing per frame
        writer.write(frame)
        written.append(frame)
    writer.release()
    return written


def test_arrays_need_an_explicit_channel_order() -> None:
    bgr = np.zeros((8, 8, 3), dtype=np.uint8)
    bgr[..., 0] = 255  # blue, in BGR
    with pytest.raises(AmbiguousChannelOrderError, match="channel_order"):
        to_rgb_image(bgr)
    assert to_rgb_image(bgr, "bgr").getpixel((0, 0)) == (0, 0, 255)
    assert to_rgb_image(bgr, "rgb").getpixel((0, 0)) == (255, 0, 0)
    assert to_rgb_image(np.full((4, 4), 7, dtype=np.uint8)).getpixel((1, 1)) == (
        7,
        7,
        7,
    )  # grey: no ambiguity


def test_unreadable_inputs_are_named(tmp_path: Path) -> None:
    with pytest.raises(UnreadableInputError, match="no image file"):
        to_rgb_image(tmp_path / "missing.png")
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image")
    with pytest.raises(UnreadableInputError, match="not a readable image"):
        to_rgb_image(junk)
    with pytest.raises(UnreadableInputError, match="PIL image"):
        to_rgb_image(42)  # type: ignore[arg-type]


def test_video_frames_are_sampled_and_converted_from_bgr(tmp_path: Path) -> None:
    path = tmp_path / "clip.avi"
    _write_video(path, frames=10)
    every = list(read_video(path))
    assert [f.index for f in every] == list(range(10))
    strided = list(read_video(path, stride=3))
    assert [f.index for f in strided] == [0, 3, 6, 9]
    by_fps = list(read_video(path, fps=5.0))
    assert [f.index for f in by_fps] == [0, 2, 4, 6, 8]
    assert by_fps[1].seconds == pytest.approx(0.2)
    r, _, b = every[0].image.getpixel((30, 50))  # below the red band: pure blue
    assert b > 150 and r < 60
    assert len(list(read_video(path, max_frames=2))) == 2


def test_empty_and_missing_videos_raise(tmp_path: Path) -> None:
    with pytest.raises(UnreadableInputError, match="no video"):
        list(read_video(tmp_path / "none.avi"))
    empty = tmp_path / "empty.avi"
    _write_video(empty, frames=0)
    with pytest.raises((EmptyVideoError, UnreadableInputError)):
        list(read_video(empty))


def test_multi_page_documents_become_pages(tmp_path: Path) -> None:
    pages = [Image.new("RGB", (40, 30), c) for c in ("red", "green", "blue")]
    path = tmp_path / "doc.tiff"
    pages[0].save(path, save_all=True, append_images=pages[1:])
    loaded = document_pages(path)
    assert [p.getpixel((0, 0)) for p in loaded] == [(255, 0, 0), (0, 128, 0), (0, 0, 255)]
    with pytest.raises(UnreadableInputError, match="no pages"):
        document_pages([])


def test_content_keys_follow_what_the_model_sees() -> None:
    backend = vl_backend("qwen2_vl")
    enc = backend.encoder
    image = Image.new("RGB", (56, 56), "red")
    a, b = enc.image(image), enc.image(image.copy(), kind="frame", label="other")
    assert a.key == b.key  # same pixels and tokens: same key, whatever the kind or label
    assert enc.image(Image.new("RGB", (56, 56), "blue")).key != a.key
    assert enc.text("hello").key == enc.text("hello").key != enc.text("hello!").key
    other = vl_backend("qwen2_5_vl").encoder.image(image)
    # the key names content, as an engine's does (`image_identity`); the model is the store's and
    # the origin's: another model's chunk is refused by its origin, never found by its key alone
    assert other.origin != a.origin


def test_processor_rejections_and_foreign_chunks_are_named() -> None:
    backend = vl_backend("qwen2_vl")
    with pytest.raises(ProcessorRejectedError, match="rejected"):
        backend.encoder.image(Image.new("RGB", (2000, 5), "red"))
    foreign = vl_backend("qwen2_5_vl").encoder.image(Image.new("RGB", (56, 56), "red"))
    window = KameraWindow(backend)
    with pytest.raises(ForeignChunkError, match="another model"):
        window.push(foreign)
    assert window.refs == [] and window.store.keys() == []
    with pytest.raises(UnsupportedModelError, match="image_processor"):
        text_backend("qwen2").encoder.image(Image.new("RGB", (56, 56), "red"))


def test_text_chunks_have_linear_or_flat_mrope_positions() -> None:
    text_chunk = text_backend("llama").encoder.text("abc")
    assert torch.equal(text_chunk.relative_positions, torch.arange(3)) and text_chunk.advance == 3
    vl_chunk = vl_backend("qwen3_vl").encoder.text("abc")
    assert torch.equal(vl_chunk.relative_positions, torch.arange(3).expand(3, 3))
