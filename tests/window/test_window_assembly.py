"""The engine cache a window keeps between answers: cropped to the chunks that did not change,
extended by the rest. Each test checks the answer against the engine's own re-prefill and the
pieces that were appended, on both backends with 4-layer models."""

from __future__ import annotations

import pytest
import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.config import WindowConfig
from kamera_agent.testing import CountingBackend
from kamera_agent.window import KameraWindow
from tests.window.backends import backend_named
from tests.window.helpers import reprefill

TEXT_BACKENDS = ["qwen2", "tiny_torch"]
A, B, C, D = "alpha one two", "gamma bee cee", "third of them", "delta seven eight"  # A, B, C: 13 chars


def window_over(name: str, **kwargs: object) -> tuple[KameraWindow, CountingBackend]:
    backend = CountingBackend(backend_named(name), **kwargs)  # type: ignore[arg-type]
    return KameraWindow(backend, config=WindowConfig.exact()), backend


def answer_error(window: KameraWindow, query: str = "What is it?") -> float:
    truth = reprefill(window, query).logits
    return float((window.ask(query, decode=DecodeConfig(max_new_tokens=2)).first_logits - truth).abs().max())


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_a_push_keeps_the_cache_its_forward_ran_over(name: str) -> None:
    """A's forward (the anchor and A's canonical) leaves its cache kept, B's conditioned forward
    appends onto it and leaves B's exact KV there: nothing is ever placed, the answer after it
    places nothing, and C's forward appends onto it too."""
    window, backend = window_over(name)
    window.push(A)
    window.push(B)
    assert backend.assembles[-1] == (0, True)  # B's forward: onto the cache A's ran in
    assert window.stats.last.tokens_placed == 0
    assert answer_error(window) < 1e-4
    assert backend.assembles[-1] == (0, True) and window.stats.last.tokens_placed == 0
    window.push(C)  # onto the kept cache: the answer's query and generated tokens are cropped
    assert backend.assembles[-1] == (0, True) and window.stats.last.tokens_placed == 0
    assert answer_error(window) < 1e-4
    assert backend.assembles[-1] == (0, True) and window.stats.last.tokens_placed == 0
    assert answer_error(window, "And now?") < 1e-4  # nothing changed: crop to the window, append nothing
    assert backend.assembles[-1] == (0, True) and window.stats.last.tokens_placed == 0


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_a_chunk_served_by_a_patch_is_placed_by_the_answer(name: str) -> None:
    """With B's canonical stored, B's formation is a rank-2 patch on it: the forward's exact
    output is not what B is served as, so the kept cache stops before B and the answer places it."""
    backend = CountingBackend(backend_named(name))
    window = KameraWindow(backend, config=WindowConfig(drift_budget=None, rank=2))
    refs = [window.push(B), window.push(A)]  # B first: its canonical is stored
    window.reorder([refs[1], refs[0]])  # B now behind A: a rank-2 patch against its canonical
    assert window.state_of(refs[0]).rank == 2
    kept = window.ask("What is it?", decode=DecodeConfig(max_new_tokens=2)).first_logits
    assert window.stats.last.tokens_placed == window.chunk(refs[0]).num_tokens  # A kept, B placed
    two = DecodeConfig(max_new_tokens=2)
    afresh = window.fork().ask("What is it?", decode=two).first_logits  # a fork assembles anew
    assert float((kept - afresh).abs().max()) < 1e-4  # rank 2 is approximate: the fork is the reference
    patched = window.ask("What is it?", decode=DecodeConfig(max_new_tokens=1)).first_logits
    window.reorder([refs[1], refs[0]])  # nothing changes
    assert torch.allclose(
        window.ask("What is it?", decode=DecodeConfig(max_new_tokens=1)).first_logits, patched, atol=1e-5
    )


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_a_chunk_whose_state_changes_in_place_is_placed_again(name: str) -> None:
    """Swapping two chunks of equal length leaves C where it was, but C now encodes B, A: the
    kept cache is cut after the anchor, and B (reverted: its canonical, never formed) and A, C
    re-formed over it come from one forward onto it (C's old piece is not reused); the answer
    then places nothing."""
    window, backend = window_over(name)
    refs = [window.push(text) for text in (A, B, C)]
    assert answer_error(window) < 1e-4
    window.reorder([refs[1], refs[0], refs[2]])
    assert backend.assembles[-1] == (0, True)  # the anchor kept, nothing placed onto it
    formed = sum(window.chunk(r).num_tokens for r in (refs[0], refs[2]))
    canonical = window.chunk(refs[1]).num_tokens  # B's first canonical (never formed before: not a re-encode)
    last = window.stats.last
    assert (last.tokens_prefilled, last.forwards, last.reforms) == (formed + canonical, 1, 0)
    assert last.canonicals_formed == 1 and window.store.has_canonical(window.chunk(refs[1]).key)
    assert answer_error(window) < 1e-4
    assert backend.assembles[-1] == (0, True) and window.stats.last.tokens_placed == 0


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_a_slide_re_places_every_survivor(name: str) -> None:
    """Survivors that keep their KV only rotate: the answer after the slide places all three."""
    backend = CountingBackend(backend_named(name))
    window = KameraWindow(backend, config=WindowConfig(drift_budget=None, survivors="keep"))
    for text in (A, B, C, D):
        window.push(text)
    window.ask("What is it?", decode=DecodeConfig(max_new_tokens=1))
    window.slide()
    window.ask("What is it?", decode=DecodeConfig(max_new_tokens=1))
    assert backend.assembles[-1] == (3, True)
    assert window.stats.last.tokens_placed == sum(window.chunk(r).num_tokens for r in window.refs)


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_survivors_re_formed_by_a_slide_are_kept_from_their_forward(name: str) -> None:
    """Exact settings: the new leftmost chunk reverts (its canonical, which the store lacks) and
    the others are re-formed over it, all in one forward; the answer after the slide places
    nothing."""
    window, backend = window_over(name)
    for text in (A, B, C, D):
        window.push(text)
    assert answer_error(window) < 1e-4
    window.slide()
    assert backend.assembles[-1] == (0, True)  # the slide's forward: B, C, D onto the kept anchor
    assert window.stats.last.forwards == 1
    assert answer_error(window) < 1e-4
    assert backend.assembles[-1] == (0, True) and window.stats.last.tokens_placed == 0


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_a_push_after_a_slide_places_the_survivors_once(name: str) -> None:
    """The pushed chunk's forward places the moved survivors; the answer after it reuses them and
    equals an answer over the same KV assembled afresh (a fork assembles its own; the survivors
    keep what they absorbed from A, so a re-prefill is not the reference here)."""
    backend = CountingBackend(backend_named(name))
    window = KameraWindow(backend, config=WindowConfig(drift_budget=None, capacity_chunks=3))
    for text in (A, B, C):
        window.push(text)
    window.ask("What is it?", decode=DecodeConfig(max_new_tokens=1))
    window.push(D)  # A slides out; B and C move left and are placed for D's forward
    survivors = sum(window.chunk(r).num_tokens for r in window.refs[:2])
    assert window.stats.last.tokens_placed == survivors
    afresh = window.fork().ask("What is it?", decode=DecodeConfig(max_new_tokens=2)).first_logits
    kept = window.ask("What is it?", decode=DecodeConfig(max_new_tokens=2)).first_logits
    assert window.stats.last.tokens_placed == 0
    assert float((kept - afresh).abs().max()) < 1e-4


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
