"""The window's face: one builder per op for the op and its dry run, one decode-settings object
(its keywords a deprecated alias), forks built like windows, the window's own encoder,
capability flags that are read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.config import WindowConfig
from kamera_agent.errors import ArgumentError, DuplicateChunkError, UnsupportedModelError, WindowError
from kamera_agent.results import Plan
from kamera_agent.testing import CountingBackend
from kamera_agent.window import KameraWindow
from tests.window.backends import backend_named

A, B, C, D = "alpha one two", "beta three four", "gamma five six", "delta seven eight"


def _window(backend: Any = None, **config: Any) -> KameraWindow:
    backend = backend or CountingBackend(backend_named("qwen2"))
    window = KameraWindow(backend, config=WindowConfig(rank=4, **config))
    for text in (A, B, C):
        window.push(text)
    return window


def _edits(plan: Plan) -> list[tuple[str, str, int]]:
    return [(edit.kind, edit.label, edit.forwards) for edit in plan.edits]


DRY_RUNS: dict[str, Callable[[KameraWindow], tuple[Plan, Plan]]] = {
    "push": lambda w: (w.plan.push(D, label="d"), w.plan("push", D, label="d")),
    "extend": lambda w: (w.plan.extend([D, "more"]), w.plan("extend", [D, "more"])),
    "replace": lambda w: (
        w.plan.replace(w.refs[1], D, append=["x"]),
        w.plan("replace", w.refs[1], D, append=["x"]),
    ),
    "reorder": lambda w: (w.plan.reorder(w.refs[::-1]), w.plan("reorder", w.refs[::-1])),
    "slide": lambda w: (w.plan.slide(2), w.plan("slide", 2)),
    "evict": lambda w: (w.plan.evict(w.refs[0], w.refs[2]), w.plan("evict", w.refs[0], w.refs[2])),
}
OPS: dict[str, Callable[[KameraWindow], object]] = {
    "push": lambda w: w.push(D, label="d"),
    "extend": lambda w: w.extend([D, "more"]),
    "replace": lambda w: w.replace(w.refs[1], D, append=["x"]),
    "reorder": lambda w: w.reorder(w.refs[::-1]),
    "slide": lambda w: w.slide(2),
    "evict": lambda w: w.evict(w.refs[0], w.refs[2]),
}


@pytest.mark.parametrize("op", sorted(DRY_RUNS))
def test_the_dry_run_view_plans_what_the_op_then_does(op: str) -> None:
    backend = CountingBackend(backend_named("qwen2"))
    window = _window(backend)
    before = (backend.total(), window.stats, window.store.stats(), window.refs)
    typed, by_name = DRY_RUNS[op](window)
    assert _edits(typed) == _edits(by_name)  # plan("op", ...) is sugar over plan.op(...)
    assert (backend.total(), window.stats, window.store.stats(), window.refs) == before  # dry
    calls = backend.calls["prefill"]
    OPS[op](window)
    assert window.stats.last.forwards == typed.forwards == backend.calls["prefill"] - calls


def test_op_arguments_are_checked_once_for_the_op_and_its_dry_run() -> None:
    window = _window()
    for run in (lambda: window.plan.slide(-1), lambda: window.slide(-1), lambda: window.plan("slide", -1)):
        with pytest.raises(ArgumentError, match=r"n must be in \[0, 3\]"):
            run()
    first = window.refs[0]
    for run in (lambda: window.plan.evict(first, first), lambda: window.evict(first, first)):
        with pytest.raises(DuplicateChunkError):
            run()
    with pytest.raises(WindowError, match="unknown op 'rotate'"):
        window.plan("rotate")


def test_decode_settings_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        DecodeConfig(5)  # type: ignore[misc]
    assert DecodeConfig(max_new_tokens=5, temperature=0.5).temperature == 0.5


def test_ask_uses_the_decode_settings_as_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked once, where the `DecodeConfig` was built: the window checks none of them again."""
    window = _window()
    decode = DecodeConfig(max_new_tokens=3, temperature=0.7, seed=4)
    monkeypatch.setattr(DecodeConfig, "__post_init__", _refused)
    pieces: list[str] = []
    answer = window.ask("What is it?", decode=decode, on_text=pieces.append)
    assert "".join(pieces) == answer.text and len(answer.tokens) <= 3


def _refused(config: DecodeConfig) -> None:
    raise AssertionError("a DecodeConfig was built during the ask")


def test_the_decode_keywords_are_a_deprecated_alias_with_the_same_answers() -> None:
    window = _window(max_new_tokens=5)
    asked = {"temperature": 0.9, "top_k": 20, "seed": 7, "stop": "zz", "logit_bias": {3: -100}}
    with pytest.warns(DeprecationWarning, match="logit_bias=, seed=, stop=, temperature=, top_k="):
        aliased = window.ask("What is it?", **asked)
    settings = DecodeConfig(
        max_new_tokens=5, temperature=0.9, top_k=20, seed=7, stop=("zz",), logit_bias={3: -100}
    )
    answer = window.ask("What is it?", decode=settings)
    assert (aliased.tokens, aliased.text) == (answer.tokens, answer.text) and len(answer.tokens) <= 5
    assert torch.equal(aliased.first_logits, answer.first_logits)
    with pytest.warns(DeprecationWarning), pytest.raises(ArgumentError, match="temperature must be finite"):
        window.ask("What is it?", temperature=-1)  # refused as an ask argument, as before


def test_decode_and_a_decode_keyword_together_are_refused() -> None:
    window = _window()
    with pytest.raises(ArgumentError, match="decode= and max_new_tokens, seed: put every decode setting"):
        window.ask("What is it?", decode=DecodeConfig(), max_new_tokens=2, seed=1)
    with pytest.raises(ArgumentError, match="unexpected keyword argument 'temprature'"):
        window.ask("What is it?", temprature=0.5)
    with pytest.raises(ArgumentError, match="decode must be a DecodeConfig"):
        window.ask("What is it?", decode={"max_new_tokens": 2})  # type: ignore[arg-type]


def test_a_fork_shares_the_store_engine_and_encoder_and_has_its_own_state() -> None:
    window = _window()
    branch = window.fork()
    assert branch.store is window.store and branch.backend is window.backend
    assert branch.encoder is window.encoder and branch.config is window.config
    branch.push(D)
    assert len(branch) == 4 and len(window) == 3
    assert branch.plan.slide(1).count("evict") == 1  # its dry runs see its own state


def test_a_conversation_window_builds_its_own_encoder() -> None:
    backend = backend_named("qwen2")
    default = backend.encoder
    window = KameraWindow(backend, system_prompt="You count.", config=WindowConfig(rank=4))
    assert window.encoder is not default and backend.encoder is default  # the backend is untouched
    assert "You count." in window.encoder.prompt.anchor and "You count." not in default.prompt.anchor
    (ref,) = window.push_message("user", "one two three")
    assert window.chunk(ref).origin == window.encoder.origin != default.origin
    assert KameraWindow(backend, config=WindowConfig(rank=4)).encoder is default


def test_an_engine_without_mla_refuses_an_mla_model_by_name() -> None:
    from tests.backends.test_transformers_backend import text_backend

    mla = text_backend("deepseek_v2")
    assert mla.layout.kind == "mla" and mla.supports_mla

    no_mla = CountingBackend(mla)
    no_mla.capabilities = replace(mla.capabilities, mla=False)
    with pytest.raises(UnsupportedModelError, match="does not run MLA"):
        KameraWindow(no_mla)
