"""The calibration's re-prefills from the first changed chunk: the model's own forward, cheaper."""

from __future__ import annotations

import pytest

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.truth import Truth
from kamera_agent.fidelity import relative_error
from tests.window.backends import backend_named

TEXTS = {
    "a": "Alice put the red key under the blue mat by the door.",
    "b": "Bob moved it to the kitchen drawer later that night.",
    "c": "Carol found a note in the drawer and read it twice.",
    "d": "Dan burned the note before anyone else could see it.",
}


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_each_lineup_is_what_a_whole_reprefill_computes_from_less_prefill(name: str) -> None:
    backend = backend_named(name)
    assert isinstance(backend, TransformersBackend)
    chunks = {label: backend.encoder.text(text) for label, text in TEXTS.items()}
    query = backend.encoder.query_ids("Where is the key?")
    truth, whole_tokens = Truth(backend), 0
    # a push into room, a reorder behind the lead, a slide, nothing changed
    for lineup in ("abc", "abcd", "acbd", "bd", "bd"):
        placed = [chunks[label] for label in lineup]
        got, want = truth(placed, query), backend.reference_prefill(placed, query)
        for kv, exact in zip(got.kv, want.kv, strict=True):
            assert relative_error(kv, exact) < 1e-5
        assert (got.logits - want.logits).abs().max() < 1e-4
        whole_tokens += backend.anchor.num_tokens + sum(c.num_tokens for c in placed) + len(query)
    assert (truth.tokens < whole_tokens) == truth.reuses
    assert truth.reuses == (name == "qwen2")  # gemma3's sliding layers are read by slot: whole
