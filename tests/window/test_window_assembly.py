"""The engine cache a window keeps between answers: cropped to the chunks that did not change,
extended by the rest. Each test checks the answer against the engine's own re-prefill and the
pieces that were appended, on both backends with 4-layer models."""

from __future__ import annotations

import pytest

from kamera_agent.config import WindowConfig
from kamera_agent.window import KameraWindow
from tests.window.backends import CountingBackend, backend_named
from tests.window.helpers import reprefill

TEXT_BACKENDS = ["qwen2", "tiny_torch"]
A, B, C, D = "alpha one two", "gamma bee cee", "third of them", "delta seven eight"  # A, B, C: 13 chars


def window_over(name: str, **kwargs: object) -> tuple[KameraWindow, CountingBackend]:
    backend = CountingBackend(backend_named(name), **kwargs)  # type: ignore[arg-type]
    return KameraWindow(backend, config=WindowConfig.exact()), backend


def answer_error(window: KameraWindow, query: str = "What is it?") -> float:
    truth = reprefill(window, query).logits
    return float((window.ask(query, max_new_tokens=2).first_logits - truth).abs().max())


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_an_answer_after_a_push_appends_only_the_pushed_chunk(name: str) -> None:
    window, backend = window_over(name)
    refs = [window.push(A), window.push(B)]
    assert answer_error(window) < 1e-4
    assert backend.assembles[-1] == (3, False)  # the first answer assembles anchor, A, B
    anchor = window.backend.encoder.anchor().num_tokens
    assert window.stats.last.tokens_placed == anchor + sum(window.chunk(r).num_tokens for r in refs)
    pushed = window.push(C)
    assert answer_error(window) < 1e-4  # the first answer's query and generated tokens are cropped
    assert backend.assembles[-1] == (1, True) and backend.calls["crop"] == 1
    assert window.stats.last.tokens_placed == window.chunk(pushed).num_tokens
    assert answer_error(window, "And now?") < 1e-4  # nothing changed: crop to the window, append nothing
    assert backend.assembles[-1] == (0, True) and window.stats.last.tokens_placed == 0


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_a_chunk_whose_state_changes_in_place_is_placed_again(name: str) -> None:
    """Swapping two chunks of equal length leaves C where it was, but C now encodes B, A:
    its piece is placed again, from the first swapped chunk on."""
    window, backend = window_over(name)
    refs = [window.push(text) for text in (A, B, C)]
    assert answer_error(window) < 1e-4
    window.reorder([refs[1], refs[0], refs[2]])
    assert answer_error(window) < 1e-4
    assert backend.assembles[-1] == (3, True)  # the anchor kept; B, A, C placed again


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_a_slide_re_places_every_survivor(name: str) -> None:
    window, backend = window_over(name)
    for text in (A, B, C, D):
        window.push(text)
    assert answer_error(window) < 1e-4
    window.slide()
    assert answer_error(window) < 1e-4
    assert backend.assembles[-1] == (3, True)


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_a_failed_op_drops_the_cache_it_may_have_cut(name: str) -> None:
    window, backend = window_over(name)
    for text in (A, B):
        window.push(text)
    assert answer_error(window) < 1e-4
    backend.fail_prefill_at = backend.calls["prefill"] + 1
    with pytest.raises(RuntimeError, match="mid-op"):
        window.push(C)
    backend.fail_prefill_at = None
    assert answer_error(window) < 1e-4
    assert backend.assembles[-1] == (3, False)  # assembled afresh, not onto what the op touched


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_forks_assemble_their_own_caches(name: str) -> None:
    window, _ = window_over(name)
    for text in (A, B):
        window.push(text)
    assert answer_error(window) < 1e-4
    branch = window.fork()
    branch.push(C)
    window.push(D)
    assert answer_error(branch) < 1e-4
    assert answer_error(window) < 1e-4
    assert answer_error(branch, "Once more?") < 1e-4
