"""No host round trip between an op's forward and its answer (`kamera_agent.critical_path`).

Every way a tensor's value reaches the host (``Tensor.item``, ``.tolist``, ``.cpu``, ``.numpy``,
``float(t)``, ``int(t)``, ``bool(t)``) and ``torch.cuda.synchronize`` are patched to raise while
an op runs in its span, from the first forward to the answer (the first chosen token id, which a
decode must bring to the host to make text). What the drift budget must bring to the host to
decide (its audits) is marked `books` and is allowed. On a CPU such a call costs no wait, but on
a GPU each stalls the engine's queue: the test fails on the call wherever it would run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kamera_agent.backends import DecodeConfig
from kamera_agent.config import WindowConfig
from kamera_agent.critical_path import answered, books, critical_path, on_critical_path
from kamera_agent.fidelity import CALIBRATION_DIR_VARIABLE
from kamera_agent.window import KameraWindow
from tests.backends.test_transformers_backend import images
from tests.window.backends import backend_named
from tests.window.helpers import calibrate_for_tests

ROUND_TRIPS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
TEXTS = [  # longer than a rank-32 patch: formed by truncated SVD, not kept whole
    "the red ball rolled left under the old wooden table by the door",
    "a green box moves slowly across the floor of the empty kitchen",
    "a grey cat sat on the warm windowsill and watched the birds outside",
    "the brown dog ran after the postman all the way down the long street",
    "the yellow sun rose over the hills and lit up the sleepy little town",
    "the blue sky turned dark as the storm clouds gathered over the sea",
]
NOTES = [  # as tests/window/test_drift_budget.py: the last note is the first chunk over ε after an evict
    "the red ball rolled",
    "green box " * 3,
    " ".join(["a long note about the morning walk and the dog"] * 4),
    "the dog ran after the kite in the rain today",
]


class HostRoundTrip(AssertionError):
    """A tensor's value was brought to the host inside an op's span."""


@pytest.fixture
def round_trips_raise(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Patch every host round trip to raise inside the span; yields the calls seen outside it
    (a guard: the patches are live, so the test could fail)."""
    outside: list[str] = []

    def guard(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(*args: Any, **kwargs: Any) -> Any:
            if on_critical_path() and _called_from_kamera():
                raise HostRoundTrip(f"{name} between an op's forward and its answer")
            outside.append(name)
            return original(*args, **kwargs)

        return patched

    for name in ROUND_TRIPS:
        monkeypatch.setattr(torch.Tensor, name, guard(f"Tensor.{name}", getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", guard("torch.cuda.synchronize", torch.cuda.synchronize))
    yield outside


def _called_from_kamera() -> bool:
    """Whether the patched call was made by kamera's code (the engine's own forward has round
    trips of its own, e.g. transformers' vision tower reads the image grid with ``tolist``: what a
    prefix cache running the same engine pays too, so they are not kamera's to remove)."""
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller == __name__ or caller.startswith("kamera_agent.")  # this module: the guard's test


@pytest.fixture
def calibrations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A calibration directory the test files its models' calibrations in (a budget then audits)."""
    monkeypatch.setenv(CALIBRATION_DIR_VARIABLE, str(tmp_path))
    return tmp_path


def _episode(window: KameraWindow, items: list[Any]) -> None:
    """Every op kind (one request's `arrange`, `replace` and `extend` too), each followed by a
    greedy answer of several tokens; then a probe and a read."""
    for i, item in enumerate(items[:4]):
        window.push(item, label=str(i))
    steps: list[Callable[[KameraWindow], object]] = [
        lambda w: w.push(items[4], label="4"),
        lambda w: w.slide(1),
        lambda w: w.reorder(list(reversed(w.refs))),
        lambda w: w.evict(w.refs[1]),
        lambda w: w.recall(w.evicted[-1]),
        lambda w: w.recall(w.evicted[0], at=0),
        lambda w: w.push(items[5], label="5"),
        lambda w: w.arrange([*w.refs[2:], w.refs[0]]),  # one request: an evict and a move
        lambda w: w.arrange([*w.refs[:2], w.evicted[-1], *w.refs[2:]]),  # and a recall
        lambda w: w.replace(w.refs[-1], items[3], append=[items[2]]),
        lambda w: w.extend([items[0], items[1]]),
    ]
    for step in steps:
        step(window)
        answer = window.ask("What is it?", decode=DecodeConfig(max_new_tokens=3))
        assert answer.tokens or answer.finish_reason == "eos"
    window.probe_without(window.refs[1], "What is it?")  # the other reads: a probe, the placed KV
    assert window.kv() is not None


def _items(backend: str) -> list[Any]:
    if backend == "qwen2_vl":
        pictures = images(3, seed=5)
        return [pictures[0], TEXTS[0], pictures[1], TEXTS[1], pictures[2], TEXTS[2]]
    return list(TEXTS)


@pytest.mark.parametrize("backend", ["qwen2", "qwen2_vl"])
@pytest.mark.parametrize("setting", ["exact", "defaults", "budgeted"])
def test_no_host_round_trip_from_the_forward_to_the_answer(
    backend: str, setting: str, round_trips_raise: list[str], calibrations: Path
) -> None:
    """Push, slide, reorder, evict, recall (in place and before the window), arrange, replace,
    extend and greedy answers,
    under the exact settings, the defaults (an uncalibrated model: run exactly), and the defaults
    with a calibration (rank-32 patches, kept survivors, orbits, the drift budget's audits)."""
    engine = backend_named(backend)
    if setting == "budgeted":
        calibrate_for_tests(engine.fingerprint, calibrations)
    config = WindowConfig.exact() if setting == "exact" else WindowConfig()
    with pytest.warns() if setting == "defaults" else _nothing():
        window = KameraWindow(engine, config=config)
    spans: list[bool] = []
    forward = engine.forward

    def seen(*args: Any, **kwargs: Any) -> Any:
        spans.append(on_critical_path())
        return forward(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "forward", seen)
        _episode(window, _items(backend))
    assert any(spans), "no forward ran inside an op's span: the test would not see a round trip"
    assert round_trips_raise, "no round trip was seen at all: are the patches live?"


def test_a_drift_budget_recompute_keeps_the_span(round_trips_raise: list[str], calibrations: Path) -> None:
    """Rank-4 patches (formed by truncated SVD), kept survivors, and the budget's cheapest fix: a
    chunk over ε gets its most deviating tokens recomputed (the tokens are chosen on the host:
    `books`), the rest of the op and the answers stay in the span."""
    engine = backend_named("qwen2")
    calibrate_for_tests(engine.fingerprint, calibrations, audit_share=0.1, recompute_share=0.3)
    window = KameraWindow(engine, config=WindowConfig(capacity_chunks=4, rank=4, drift_budget=0.08))
    for note in NOTES:
        window.push(note, label=note[:8])
    first, evicted, vouched, _ = window.refs
    budget = window._parts.budget
    assert budget is not None
    budget.always_try = True
    budget.remember(window.state_of(vouched), window._parts.core.root.extend(window.state_of(first)), 0.0)
    window.evict(evicted)
    assert window.stats.last.drift_recomputes == 1, window.last_plan
    window.ask("What is it?", decode=DecodeConfig(max_new_tokens=3))
    window.recall(evicted, at=0)
    window.ask("What is it?", decode=DecodeConfig(max_new_tokens=3))
    assert window.stats.total.audits > 0


def test_reusing_the_last_answers_tokens_keeps_the_span(round_trips_raise: list[str]) -> None:
    """A conversation's next turn reuses the slots its last decode fed (`kamera_agent.window.tail`),
    one chunk of them cut where the reused tokens end, and prefills the rest in the span."""
    window = KameraWindow(backend_named("qwen2"), config=WindowConfig.exact(), system_prompt="Be terse.")
    conversation = window.conversation
    assert conversation is not None

    def message(role: str, text: str, tag: str, closed: bool = True) -> list[Any]:
        labels = [f"{tag}.0"]
        return conversation.message(role, [text], closed=closed, labels=labels, markers_apart=True)

    first = message("user", TEXTS[0], "u0", closed=False)
    window.arrange(first)
    answer = window.ask("", in_message=True, decode=DecodeConfig(max_new_tokens=4, logit_bias={111: 100.0}))
    turn = [*message("user", TEXTS[0], "u0"), *message("assistant", answer.text, "a0")]
    window.arrange([*window.refs, *turn[len(first) :], *message("user", TEXTS[1], "u1", closed=False)])
    assert window.stats.last.tokens_reused > 0, window.last_plan  # the tail was reused
    window.ask("", in_message=True, decode=DecodeConfig(max_new_tokens=2))


def test_the_patches_would_fail_a_round_trip_in_the_span(round_trips_raise: list[str]) -> None:
    """The guard itself: inside the span each round trip raises; in `books` and after `answered` not."""
    tensor = torch.ones(2)
    with critical_path():
        for call in (lambda: tensor[0].item(), lambda: tensor.tolist(), lambda: bool(tensor[0])):
            with pytest.raises(HostRoundTrip):
                call()
        with books("a test decides on a value"):
            assert tensor[0].item() == 1.0
        with pytest.raises(HostRoundTrip):
            float(tensor[0])
        answered()
        assert int(tensor[0]) == 1
    assert not on_critical_path()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
