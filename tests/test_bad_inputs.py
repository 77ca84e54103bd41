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

from kamera_agent import DecodeConfig, KameraWindow, WindowConfig
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.chunks.sources import read_video, to_rgb_image
from kamera_agent.demo.model import load_demo_model
from kamera_agent.errors import (
    ArgumentError,
    CheckpointError,
    ConfigError,
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
    w = KameraWindow(_demo(), config=WindowConfig(evicted_pixels="retain"))
    w.push(Image.new("RGB", (56, 56), (200, 30, 30)), label="frame")
    w.push("a note", label="note")
    return w


CASES: dict[str, tuple[Callable[[KameraWindow, Path], Any], type[KameraError], str]] = {
    "empty text": (lambda w, d: w.push(""), InputError, "no tokens"),
    "unknown kind": (lambda w, d: w.push("x", kind="photo"), InputError, "not a chunk kind"),
    "text as an image kind": (lambda w, d: w.push("x", kind="frame"), InputError, "kind='text'"),
    "negative slide": (lambda w, d: w.slide(-1), ArgumentError, "n must be in"),
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
        ArgumentError,
        "'rgb', 'bgr'",
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
    "temperature NaN": (lambda w, d: DecodeConfig(temperature=float("nan")), SettingsError, "temperature"),
    "temperature < 0": (lambda w, d: DecodeConfig(temperature=-1), SettingsError, "temperature"),
    "top_p > 1": (lambda w, d: DecodeConfig(top_p=5), SettingsError, "top_p"),
    "no answer tokens": (lambda w, d: DecodeConfig(max_new_tokens=0), SettingsError, "max_new_tokens"),
    "negative answer tokens": (lambda w, d: DecodeConfig(max_new_tokens=-3), SettingsError, "max_new_tokens"),
    "empty stop string": (lambda w, d: DecodeConfig(stop=("",)), SettingsError, "stop"),
    "decode not a DecodeConfig": (
        lambda w, d: w.ask("q", decode={"temperature": 1}),
        ArgumentError,
        "decode",
    ),
    # the wrong-typed arguments a review sent (issue 35): each a named error, nothing changed
    "caption not a str": (
        lambda w, d: w.push(Image.new("RGB", (56, 56)), caption=5),
        ArgumentError,
        "caption",
    ),
    "label not a str": (lambda w, d: w.push("x", label=123), ArgumentError, "label"),
    "reorder None": (lambda w, d: w.reorder(None), ArgumentError, "refs must be a list"),
    "recall at a float": (lambda w, d: w.recall(w.refs[0], at=1.5), ArgumentError, "at must be an int"),
    "recall at a str": (lambda w, d: w.recall(w.refs[0], at="0"), ArgumentError, "at must be an int"),
    "slide a float": (lambda w, d: w.slide(1.5), ArgumentError, "int n"),
    "slide NaN": (lambda w, d: w.slide(float("nan")), ArgumentError, "int n"),
    "slide a str": (lambda w, d: w.slide("1"), ArgumentError, "int n"),
    "slide past the window": (lambda w, d: w.slide(10**9), ArgumentError, r"must be in \[0, 2\]"),
    "replace append an int": (
        lambda w, d: w.replace(w.refs[0], "x", append=5),
        ArgumentError,
        "list of items",
    ),
    "extend a str": (lambda w, d: w.extend("abc"), ArgumentError, "push it"),
    "labels not one per item": (lambda w, d: w.extend(["a", "b"], labels=["a"]), ArgumentError, "one label"),
    "ask None": (lambda w, d: w.ask(None), ArgumentError, "query must be a str"),
    "ask an int": (lambda w, d: w.ask(123), ArgumentError, "query must be a str"),
    "a huge seed": (lambda w, d: DecodeConfig(seed=2**70), SettingsError, "seed"),
    "stop an int": (lambda w, d: DecodeConfig(stop=5), SettingsError, "stop"),
    "ask on_text not callable": (lambda w, d: w.ask("q", on_text="print"), ArgumentError, "on_text"),
    "probe a None query": (lambda w, d: w.probe_without(w.refs[0], None), ArgumentError, "query"),
    "arrange a str": (lambda w, d: w.arrange("ab"), ArgumentError, "list of items"),
    "window of None": (lambda w, d: KameraWindow(None), ArgumentError, "needs a model"),
    "config not a WindowConfig": (
        lambda w, d: KameraWindow(w.backend, config={"rank": 4}),
        ArgumentError,
        "config",
    ),
    "config refused": (lambda w, d: WindowConfig(rank=-1), ConfigError, "rank"),
    "unknown config field": (lambda w, d: WindowConfig(ranks=4), ConfigError, "ranks"),
    "window past the context": (
        lambda w, d: w.extend(["word " * 300, "more " * 300, "else " * 300]),
        ContextOverflowError,
        "would make the window",
    ),
    "missing model folder": (
        lambda w, d: KameraWindow(str(d / "no-such-model")),
        CheckpointError,
        "no checkpoint at",
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
    if name == "recall outside":  # its setup evicted one chunk on purpose (and stored what it formed)
        refs, keys = refs[1:], window.store.keys() if window.stats.last.forwards else keys
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
    assert "refused" in out and "no checkpoint at" in out and "Traceback" not in out


# Every public op, each argument replaced by values of the wrong type or out of range.
_BAD = (None, 1.5, float("nan"), float("inf"), 2**70, -1, "x", [], {}, object(), True)
_OPS: dict[str, Callable[[KameraWindow, Any], Any]] = {
    "push item": lambda w, v: w.push(v),
    "push label": lambda w, v: w.push("y", label=v),
    "push kind": lambda w, v: w.push("y", kind=v),
    "push caption": lambda w, v: w.push(Image.new("RGB", (56, 56)), caption=v),
    "push channel_order": lambda w, v: w.push(np.zeros((8, 8, 3), np.uint8), channel_order=v),
    "extend items": lambda w, v: w.extend(v),
    "extend labels": lambda w, v: w.extend(["y"], labels=v),
    "replace ref": lambda w, v: w.replace(v, "y"),
    "replace item": lambda w, v: w.replace(w.refs[0], v),
    "replace append": lambda w, v: w.replace(w.refs[0], "y", append=v),
    "reorder refs": lambda w, v: w.reorder(v),
    "slide n": lambda w, v: w.slide(v),
    "evict ref": lambda w, v: w.evict(v),
    "recall ref": lambda w, v: w.recall(v),
    "recall at": lambda w, v: w.recall(w.refs[0], at=v),
    "arrange items": lambda w, v: w.arrange(v),
    "arrange labels": lambda w, v: w.arrange(w.refs, labels=v),
    "forget ref": lambda w, v: w.forget(v),
    "ask query": lambda w, v: w.ask(v),
    "ask decode": lambda w, v: w.ask("q", decode=v),
    "ask max_new_tokens": lambda w, v: w.ask("q", decode=DecodeConfig(max_new_tokens=v)),
    "ask temperature": lambda w, v: w.ask("q", decode=DecodeConfig(temperature=v)),
    "ask top_k": lambda w, v: w.ask("q", decode=DecodeConfig(top_k=v)),
    "ask top_p": lambda w, v: w.ask("q", decode=DecodeConfig(top_p=v)),
    "ask seed": lambda w, v: w.ask("q", decode=DecodeConfig(seed=v)),
    "ask stop": lambda w, v: w.ask("q", decode=DecodeConfig(stop=v)),
    "ask logit_bias": lambda w, v: w.ask("q", decode=DecodeConfig(logit_bias=v)),
    "ask top_logprobs": lambda w, v: w.ask("q", decode=DecodeConfig(top_logprobs=v)),
    "ask return_logits": lambda w, v: w.ask("q", return_logits=v),
    "ask on_text": lambda w, v: w.ask("q", on_text=v),
    "ask keep_going": lambda w, v: w.ask("q", keep_going=v),
    "ask in_message": lambda w, v: w.ask("q", in_message=v),
    "ask query_role": lambda w, v: w.ask("q", query_role=v),
    "ask remember": lambda w, v: w.ask("q", remember=v),
    "probe ref": lambda w, v: w.probe_without(v, "q"),
    "probe query": lambda w, v: w.probe_without(w.refs[0], v),
    "probe max_new_tokens": lambda w, v: w.probe_without(w.refs[0], "q", max_new_tokens=v),
    "chunk_kv ref": lambda w, v: w.chunk_kv(v),
    "state_of ref": lambda w, v: w.state_of(v),
    "query_ids query": lambda w, v: w.query_ids(v),
    "as_model_inputs query": lambda w, v: w.as_model_inputs(v),
    "plan op": lambda w, v: w.plan(v),
    "config rank": lambda w, v: WindowConfig(rank=v),
    "config capacity": lambda w, v: WindowConfig(capacity_chunks=v),
}
_ACCEPTED: list[tuple[str, object, str]] = [
    # (op, value, why): documented behaviour, not bad input
    ("ask decode", None, "greedy, the window's max_new_tokens"),
    ("ask top_logprobs", None, "no log-probabilities"),
    ("ask logit_bias", {}, "no bias"),
    ("ask seed", None, "unseeded"),
    ("ask on_text", None, "no streaming"),
    ("ask keep_going", None, "never cancelled"),
    ("ask temperature", 1.5, "sampled at 1.5"),
    ("ask top_k", 2**70, "top-k above the vocabulary keeps every token"),
    ("ask return_logits", True, "logits returned"),
    ("as_model_inputs query", None, "the window without a query"),
    ("as_model_inputs query", "x", "a query"),
    ("query_ids query", "x", "a query"),
    ("ask query", "x", "a query"),
    ("probe query", "x", "a query"),
    ("push item", "x", "a text"),
    ("push label", None, "no label"),
    ("push label", "x", "a label"),
    ("push kind", None, "the item's own kind"),
    ("push caption", None, "no caption"),
    ("push caption", "x", "a caption"),
    ("extend items", [], "nothing to add: an op that changes nothing"),
    ("extend labels", None, "no labels"),
    ("replace append", [], "nothing appended"),
    ("replace item", "x", "a text"),
    ("recall at", None, "the end"),
    ("arrange labels", None, "no labels"),
    ("arrange items", [], "the window emptied: arrange holds exactly what it is given"),
    ("ask temperature", 2**70, "any finite temperature >= 0 (a huge one samples uniformly)"),
    ("config capacity", 2**70, "a capacity never reached"),
    ("config rank", 2**70, "a rank at or above a chunk's full rank is full rank"),
    ("replace append", None, "nothing appended"),
    ("config capacity", None, "unbounded"),
]


def _accepted(op: str, value: object) -> bool:
    return any(o == op and type(v) is type(value) and v == value for o, v, _ in _ACCEPTED)


@pytest.mark.parametrize("op", sorted(_OPS))
def test_type_fuzz_every_public_op_refuses_by_name_and_changes_nothing(op: str) -> None:
    """Each bad value: a `KameraError` (or documented behaviour), the window and store unchanged."""
    w = KameraWindow(_demo(), config=WindowConfig(evicted_pixels="retain"))
    w.push("a note", label="note")
    w.push("another note", label="other")
    for value in _BAD:
        refs, evicted, keys = w.refs, w.evicted, w.store.keys()
        try:
            _OPS[op](w, value)
        except KameraError:
            assert (w.refs, w.evicted, w.store.keys()) == (refs, evicted, keys), (op, value)
            continue
        assert _accepted(op, value), f"{op} accepted {value!r} silently"
