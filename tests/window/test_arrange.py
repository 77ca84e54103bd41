"""``window.arrange`` (the window as a given list, in one op) and the prefix-cache bound on every op.

A prefix cache pays the tokens from the first changed slot on; no window op may pay more. The
cases here are the ones that did before the bound: a recall formed over its original context
(which rebuilt that context), and a request's edit run as evict + reorder + recall + extend.
Fidelity is checked against the engine's own re-prefill of the window.
"""

from __future__ import annotations

import pytest

from kamera_agent.config import WindowConfig
from kamera_agent.errors import CapacityError, DuplicateChunkError, UnknownChunkError
from kamera_agent.store import ChunkStore
from kamera_agent.window import ChunkRef, KameraWindow
from tests.window.backends import backend_named
from tests.window.helpers import answer_kl, chunk_errors

EXACT = 2e-5
TEXTS = ["the red ball rolled left", "a blue box", "green light on", "the cat sat down", "yellow sun"]


@pytest.fixture(params=["qwen2", "tiny_torch"])
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _window(name: str, config: WindowConfig, budget: int = 1 << 26) -> tuple[KameraWindow, list[ChunkRef]]:
    backend = backend_named(name)
    w = KameraWindow(
        backend, config=config, store=ChunkStore(fingerprint=backend.fingerprint, memory_limit=budget)
    )
    return w, [w.push(text, label=text.split()[1]) for text in TEXTS[:4]]


def _crowd_out(w: KameraWindow) -> None:
    """Another window over the same small store pushes until the store has dropped entries (the
    evicted chunks' stored KV over their original context among them)."""
    other = KameraWindow(w.backend, config=w.config, store=w.store)
    for i in range(12):
        other.push(f"filler number {i} of many")
    assert w.store.stats().lost > 0


def _from_first_change(before: list[str], w: KameraWindow) -> int:
    """What a prefix cache prefills to go from the content ``before`` to the window now."""
    after = [w.chunk(ref) for ref in w.refs]
    same = 0
    while same < min(len(before), len(after)) and before[same] == after[same].key:
        same += 1
    return sum(chunk.num_tokens for chunk in after[same:])


def test_arrange_evicts_moves_recalls_and_admits_in_one_exact_op(backend_name: str) -> None:
    w, (a, b, c, d) = _window(backend_name, WindowConfig.exact())
    w.evict(b)
    before = [w.chunk(ref).key for ref in w.refs]
    refs = w.arrange([a, b, d, "a new line of text"], labels=[None, None, None, "new"])
    assert w.refs == refs and refs[:3] == [a, b, d] and refs[3].label == "new"
    assert c in w.evicted and b not in w.evicted
    assert w.stats.ops["arrange"] == 1
    assert w.stats.last.tokens_prefilled <= _from_first_change(before, w)
    edits = {edit.kind for edit in w.last_plan.edits} if w.last_plan else set()
    assert {"evict", "recall", "admit"} <= edits
    assert max(chunk_errors(w).values()) <= EXACT
    assert answer_kl(w) < 1e-9


def test_arrange_refuses_bad_lists_and_changes_nothing(backend_name: str) -> None:
    w, (a, b, c, d) = _window(backend_name, WindowConfig(drift_budget=None, capacity_chunks=4))
    before = (w.refs, w.stats)
    with pytest.raises(DuplicateChunkError):
        w.arrange([a, a])
    with pytest.raises(CapacityError, match="capacity_chunks"):
        w.arrange([a, b, c, d, "one too many"])
    stranger = KameraWindow(backend_named(backend_name)).push("elsewhere")
    with pytest.raises(UnknownChunkError):
        w.arrange([a, stranger])
    assert (w.refs, w.stats) == before
    assert w.plan.arrange([d, c]).count("evict") == 2  # a dry run


@pytest.mark.parametrize("settings", ["exact", "defaults", "original context"])
def test_a_recall_at_the_end_costs_at_most_the_recalled_chunk(backend_name: str, settings: str) -> None:
    """Recalled last, after the chunk that followed it left as well (nothing in the window
    absorbed it): a prefix cache prefills that chunk's tokens; so does the window, whatever its
    settings (the original-context recall used to rebuild that context first)."""
    config = {
        "exact": WindowConfig.exact(),
        "defaults": WindowConfig(drift_budget=None),
        "original context": WindowConfig(drift_budget=None, rank=4, recall_context="original"),
    }[settings]
    w, (a, b, c, d) = _window(backend_name, config, budget=40_000)
    w.evict(c, d)  # c absorbed a and b; nothing absorbed c but d, which left too
    _crowd_out(w)  # c's stored KV over its original context is gone: it must be formed again
    w.recall(c)
    assert w.refs == [a, b, c]
    assert w.stats.last.tokens_prefilled <= w.chunk(c).num_tokens
    if settings == "exact":
        assert max(chunk_errors(w).values()) <= EXACT


def test_the_bound_takes_the_re_prefill_when_the_plan_costs_more(backend_name: str) -> None:
    """A recall in its original context whose stored KV the store dropped rebuilds that context
    (72 tokens on these models); re-prefilling from the recalled slot costs the chunk's own
    tokens, and the plan says which it runs and why."""
    w, (_, _, c, d) = _window(
        backend_name, WindowConfig(drift_budget=None, rank=4, recall_context="original"), budget=40_000
    )
    w.evict(c, d)
    _crowd_out(w)
    planned = w.plan.recall(c)
    assert planned.tokens_prefilled == w.chunk(c).num_tokens
    (formed,) = [edit for edit in planned.edits if edit.kind == "form_patch"]
    assert formed.ref == c and "re-prefill from slot 2" in formed.detail
    w.recall(c)
    assert w.stats.last.tokens_prefilled == planned.tokens_prefilled
    assert max(chunk_errors(w).values()) <= EXACT  # the re-prefill is exact over what is left of it
