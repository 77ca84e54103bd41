"""Every bad input a newcomer (or a fuzzer) sent: a named `KameraError`, and nothing changed.

Each case runs against a window holding two chunks; after the refusal the window's chunks,
its costs and the store's entries must be exactly what they were. Inputs that are valid but
were read unlike the model's own processor (transparency, 16-bit pixels) are checked against
that processor.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from kamera_agent import KameraWindow, WindowConfig
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.chunks.sources import read_video, to_rgb_image
from kamera_agent.demo.model import load_demo_model
from kamera_agent.errors import (
    CheckpointError,
    ContextOverflowError,
    InputError,
    KameraError,
    LargeChunkWarning,
    SettingsError,
    UnreadableInputError,
    WindowError,
)
from tests.window.backends import backend_named


def _bomb(path: Path) -> Path:
    """A tiny PNG whose header claims 20000 x 20000 pixels."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
    path.write_bytes(png + chunk(b"IEND", b""))
    return path


@cache
def _demo() -> TransformersBackend:
    """The shipped demo model (a 4,096-position context: over-long chunks are refused there)."""
    model, tokenizer, image_processor = load_demo_model()
    return TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)


@pytest.fixture
def window() -> KameraWindow:
    w = KameraWindow(_demo(), config=WindowConfig(evicted_pixels="keep"))
    w.push(Image.new("RGB", (56, 56), (200, 30, 30)), label="frame")
    w.push("a note", label="note")
    return w


CASES: dict[str, tuple[Callable[[KameraWindow, Path], Any], type[KameraError], str]] = {
    "empty text": (lambda w, d: w.push(""), InputError, "no tokens"),
    "unknown kind": (lambda w, d: w.push("x", kind="photo"), InputError, "not a chunk kind"),
    "text as an image kind": (lambda w, d: w.push("x", kind="frame"), InputError, "kind='text'"),
    "negative slide": (lambda w, d: w.slide(-1), WindowError, "n >= 0"),
    "recall outside": (
        lambda w, d: (w.evict(w.refs[0]), w.recall(w.evicted[0], at=-1)),
        WindowError,
        "outside",
    ),
    "unknown plan op": (lambda w, d: w.plan("shuffle"), WindowError, "unknown op"),
    "0x0 image": (lambda w, d: w.push(Image.new("RGB", (0, 0))), UnreadableInputError, "no pixels"),
    "decompression bomb": (
        lambda w, d: w.push(_bomb(d / "bomb.png")),
        UnreadableInputError,
        "over the limit",
    ),
    "object array": (
        lambda w, d: w.push(np.array([[object()] * 4] * 4), channel_order="rgb"),
        UnreadableInputError,
        "dtype object",
    ),
    "text array": (
        lambda w, d: w.push(np.full((8, 8, 3), "a"), channel_order="rgb"),
        UnreadableInputError,
        "not an image",
    ),
    "bool array": (
        lambda w, d: w.push(np.ones((8, 8, 3), bool), channel_order="rgb"),
        UnreadableInputError,
        "dtype bool",
    ),
    "complex array": (
        lambda w, d: w.push(np.ones((8, 8, 3), np.complex64), channel_order="rgb"),
        UnreadableInputError,
        "complex64",
    ),
    "NaN array": (
        lambda w, d: w.push(np.full((8, 8, 3), np.nan, np.float32), channel_order="rgb"),
        UnreadableInputError,
        "NaN",
    ),
    "inf array": (
        lambda w, d: w.push(np.full((8, 8, 3), np.inf), channel_order="rgb"),
        UnreadableInputError,
        "infinity",
    ),
    "int64 out of range": (
        lambda w, d: w.push(np.full((8, 8, 3), 300), channel_order="rgb"),
        UnreadableInputError,
        "0..255",
    ),
    "unknown channel order": (
        lambda w, d: w.push(np.zeros((8, 8, 3), np.uint8), channel_order="xyz"),
        UnreadableInputError,
        "'rgb' or 'bgr'",
    ),  # type: ignore[arg-type]
    "lone surrogate": (lambda w, d: w.push("bad \ud800 text"), InputError, "not valid Unicode"),
    "huge caption": (
        lambda w, d: w.push(Image.new("RGB", (56, 56)), caption="x" * 50_000),
        ContextOverflowError,
        "cannot fit",
    ),
    "chunk longer than the context": (
        lambda w, d: w.push("word " * 5000),
        ContextOverflowError,
        "cannot fit",
    ),
    "temperature NaN": (lambda w, d: w.ask("q", temperature=float("nan")), SettingsError, "temperature"),
    "temperature < 0": (lambda w, d: w.ask("q", temperature=-1), SettingsError, "temperature"),
    "top_p > 1": (lambda w, d: w.ask("q", top_p=5), SettingsError, "top_p"),
    "no answer tokens": (lambda w, d: w.ask("q", max_new_tokens=0), SettingsError, "max_new_tokens"),
    "negative answer tokens": (lambda w, d: w.ask("q", max_new_tokens=-3), SettingsError, "max_new_tokens"),
    "empty stop string": (lambda w, d: w.ask("q", stop=[""]), SettingsError, "stop"),
    "missing model folder": (
        lambda w, d: KameraWindow(str(d / "no-such-model")),
        CheckpointError,
        "no checkpoint folder",
    ),
    "folder without config": (lambda w, d: KameraWindow(str(d)), CheckpointError, "config.json"),
    "cuda on a CPU torch": (
        lambda w, d: KameraWindow(
            w.backend.model, tokenizer=w.backend.tokenizer, config=WindowConfig(device="cuda:0")
        ),  # type: ignore[attr-defined]
        SettingsError,
        "device",
    ),
    "video stride 0": (
        lambda w, d: list(read_video(d / "clip.mp4", stride=0)),
        UnreadableInputError,
        "stride",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_bad_input_is_a_named_error_that_changes_nothing(
    name: str, window: KameraWindow, tmp_path: Path
) -> None:
    if name == "cuda on a CPU torch" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    act, error, words = CASES[name]
    refs, keys, total = list(window.refs), window.store.keys(), window.stats.total
    with pytest.raises(error, match=words):
        act(window, tmp_path)
    if name == "recall outside":  # its setup evicted one chunk on purpose
        refs = refs[1:]
    assert window.refs == refs and window.store.keys() == keys
    if name != "recall outside":
        assert window.stats.total == total


def test_transparency_is_composited_on_white_as_the_models_processor_does() -> None:
    backend = backend_named("qwen2_vl")
    rgba = Image.new("RGBA", (56, 56), (255, 0, 0, 0))  # fully transparent red
    rgba.putpixel((3, 3), (0, 0, 255, 255))
    ours = backend.encoder.image(rgba).pixel_values
    theirs = backend.encoder.image_processor(images=[rgba.convert("RGBA")], return_tensors="pt")[
        "pixel_values"
    ]
    white = backend.encoder.image(Image.new("RGB", (56, 56), "white")).pixel_values
    assert torch.allclose(ours, theirs.float()) and not torch.equal(ours, white)
    array = np.zeros((56, 56, 4), np.uint8)
    array[..., 0] = 255  # red, alpha 0: white
    assert to_rgb_image(array, "rgb").getpixel((0, 0)) == (255, 255, 255)


def test_sixteen_bit_and_float_pixels_are_scaled_not_saturated() -> None:
    sixteen = np.full((4, 4, 3), 257 * 100, np.uint16)
    assert to_rgb_image(sixteen, "rgb").getpixel((0, 0)) == (100, 100, 100)
    assert to_rgb_image(np.full((4, 4, 3), 0.5), "rgb").getpixel((0, 0)) == (128, 128, 128)
    assert to_rgb_image(np.full((4, 4, 3), 200.0), "rgb").getpixel((0, 0)) == (200, 200, 200)
    assert to_rgb_image(np.full((4, 4, 3), 7, np.int64), "rgb").getpixel((0, 0)) == (7, 7, 7)


def test_a_large_chunk_warns_and_is_admitted() -> None:
    window = KameraWindow(backend_named("qwen2_vl"), config=WindowConfig(large_chunk_tokens=8))  # type: ignore[arg-type]
    with pytest.warns(LargeChunkWarning, match="large_chunk_tokens=8"):
        window.push("a sentence that is certainly longer than eight tokens in any tokenizer")
    assert len(window.refs) == 1


def test_window_chunk_and_stats_print_readably() -> None:
    window = KameraWindow(_demo())
    ref = window.push(Image.new("RGB", (56, 56)), label="frame 0")
    window.push("a note", label="note")
    assert repr(window.chunk(ref)).startswith("Chunk(image 'frame 0', ") and "tensor" not in repr(
        window.chunk(ref)
    )
    text = repr(window)
    assert (
        text.startswith("KameraWindow(window: 2 chunks [frame 0, note], 0 evicted")
        and "object at" not in text
    )
    assert "push×2" in repr(window.stats) and "tokens prefilled" in repr(window.stats)


def test_the_cli_takes_threads_after_the_command_and_names_a_refused_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kamera_agent.cli import main

    assert main(["store", "stats", "--threads", "1", "--url", "http://nowhere"]) == 2  # parsed, then refused
    assert main(["check", str(tmp_path / "missing")]) == 2
    out = capsys.readouterr().out
    assert "refused" in out and "no checkpoint folder" in out and "Traceback" not in out
