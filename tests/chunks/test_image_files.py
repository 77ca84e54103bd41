"""Images read from files through every reader equal the same image pushed from memory.

Why a test of its own: PIL decodes lazily, and an image returned from inside ``with
Image.open(...)`` was invalid once the file closed, so every ordinary RGB PNG or JPEG failed with
an empty ``AssertionError`` while the tests only tried paths that should fail.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kamera_agent import KameraWindow, MediaPathAsTextError, Text, UnreadableInputError
from kamera_agent.chunks import document_pages, to_rgb_image
from tests.backends.test_transformers_backend import vl_backend

# format name -> (suffix, whether the format keeps every pixel of an RGB image)
FORMATS = {
    "PNG": (".png", True),
    "JPEG": (".jpg", False),
    "WEBP": (".webp", True),  # saved lossless below
    "BMP": (".bmp", True),
    "GIF": (".gif", False),  # a palette: colours are quantised
    "TIFF": (".tiff", True),
}


def _picture(seed: int, size: tuple[int, int] = (56, 56)) -> Image.Image:
    """A picture with structure (blocks), so a lossy format keeps it recognisable."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 255, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
    return Image.fromarray(np.kron(blocks, np.ones((8, 8, 1), dtype=np.uint8)))


def _save(image: Image.Image, folder: Path, fmt: str, stem: str = "picture") -> Path:
    suffix, _ = FORMATS[fmt]
    path = folder / f"{stem}{suffix}"
    options = {"lossless": True} if fmt == "WEBP" else {}
    image.save(path, format=fmt, **options)
    return path


def _decoded(path: Path) -> Image.Image:
    """What the file decodes to, read from bytes already in memory (the reference)."""
    with Image.open(io.BytesIO(path.read_bytes())) as image:
        return image.convert("RGB")


@pytest.fixture(scope="module")
def window_backend():  # type: ignore[no-untyped-def]
    return vl_backend("qwen2_vl")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_to_rgb_image_reads_each_format_whole(tmp_path: Path, fmt: str) -> None:
    original = _picture(1)
    path = _save(original, tmp_path, fmt)
    read = to_rgb_image(path)
    assert read.mode == "RGB" and read.size == original.size
    assert np.array_equal(np.asarray(read), np.asarray(_decoded(path)))
    if FORMATS[fmt][1]:
        assert np.array_equal(np.asarray(read), np.asarray(original))
    assert np.array_equal(np.asarray(to_rgb_image(str(path))), np.asarray(read))  # a str path too


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_png_of_every_mode_is_read_as_rgb(tmp_path: Path, mode: str) -> None:
    image = _picture(2).convert(mode)
    path = tmp_path / f"m{mode}.png"
    image.save(path)
    assert np.array_equal(np.asarray(to_rgb_image(path)), np.asarray(to_rgb_image(image)))


def test_a_gif_gives_its_first_frame(tmp_path: Path) -> None:
    frames = [Image.new("RGB", (40, 30), colour) for colour in ("red", "blue", "green")]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50)
    assert to_rgb_image(path).getpixel((5, 5)) == (255, 0, 0)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_push_and_extend_of_a_file_equal_the_image_in_memory(
    tmp_path: Path, fmt: str, window_backend
) -> None:  # type: ignore[no-untyped-def]
    path = _save(_picture(3), tmp_path, fmt)
    other = _save(_picture(4), tmp_path, fmt, stem="other")
    in_memory = KameraWindow(window_backend)
    want = [in_memory.push(_decoded(path)).key, *(ref.key for ref in in_memory.extend([_decoded(other)]))]
    from_files = KameraWindow(window_backend)
    got = [from_files.push(path).key, *(ref.key for ref in from_files.extend([other]))]
    assert got == want  # the content key hashes the preprocessed pixels and the tokens


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "TIFF"])
def test_document_pages_from_a_list_of_files(tmp_path: Path, fmt: str) -> None:
    paths = [_save(_picture(seed), tmp_path, fmt, stem=f"page{seed}") for seed in (5, 6)]
    pages = document_pages(paths)
    for page, path in zip(pages, paths, strict=True):
        assert np.array_equal(np.asarray(page), np.asarray(_decoded(path)))


def test_document_pages_of_a_multi_page_file_outlive_it(tmp_path: Path) -> None:
    pictures = [_picture(seed) for seed in (7, 8, 9)]
    path = tmp_path / "doc.tiff"
    pictures[0].save(path, save_all=True, append_images=pictures[1:])
    pages = document_pages(path)
    for page, picture in zip(pages, pictures, strict=True):
        assert np.array_equal(np.asarray(page.copy()), np.asarray(picture))


def test_a_video_path_points_to_read_video(tmp_path: Path, window_backend) -> None:  # type: ignore[no-untyped-def]
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\x00" * 64)
    with pytest.raises(UnreadableInputError, match="read_video"):
        to_rgb_image(clip)
    window = KameraWindow(window_backend)
    with pytest.raises(UnreadableInputError, match="read_video"):
        window.push(clip)
    assert window.refs == [] and window.store.keys() == []


@pytest.mark.parametrize("text", ["screenshot.png", "/nonexistent/image.png", "Frame.JPEG", "clip.mp4"])
def test_a_str_that_looks_like_a_media_path_is_refused(text: str, window_backend) -> None:  # type: ignore[no-untyped-def]
    window = KameraWindow(window_backend)
    with pytest.raises(MediaPathAsTextError, match=r"Path\(.*Text\("):
        window.push(text)
    with pytest.raises(MediaPathAsTextError):
        window.extend(["a line", text])
    assert window.refs == [] and window.store.keys() == []
    pushed = window.push(Text(text))  # the documented way to push such characters as text
    assert pushed.key == window.encoder.text(text).key


@pytest.mark.parametrize("text", ["see screenshot.png above", "version 1.2", "a.png.", "plain text"])
def test_text_that_merely_mentions_a_file_is_text(text: str, window_backend) -> None:  # type: ignore[no-untyped-def]
    window = KameraWindow(window_backend)
    assert window.push(text).key == window.encoder.text(text).key
