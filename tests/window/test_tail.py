"""A conversation's next turn keeps what the last decode fed: its question's framing and answer.

Why: the next request sends, right after the messages the window holds, the closing of the
question just answered, the assistant's opening and the answer, which the decode ran through
the model at those positions a moment before. A prefix cache (vLLM's, SGLang's) reuses those
blocks; a window that prefilled them again would cost more than one. Each test checks the cost
(the plan's forecast and the op's) and that the window still answers like the model's own
forward over the whole conversation, and that its chunks' KV is what that forward computes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.config import WindowConfig
from kamera_agent.window import KameraWindow
from tests.kv_helpers import rel_err
from tests.window.backends import backend_named

EXACT = 1e-4
LETTER_O = 111
"""The tiny tokenizers' id of ``o``: a bias makes every answer ``ooooo`` (five tokens, which
the text ``ooooo`` tokenizes back to), so the answer the next turn sends is the one decoded."""
FIVE_OS = DecodeConfig(max_new_tokens=5, logit_bias={LETTER_O: 100.0})
PAGE = "the first page: " + " ".join(f"item {i} costs {i * 3} coins" for i in range(12))


def _window(name: str) -> KameraWindow:
    return KameraWindow(backend_named(name), config=WindowConfig.exact(), system_prompt="Be terse.")


def _message(window: KameraWindow, role: str, text: str, tag: str, closed: bool = True) -> list[Any]:
    conversation = window.conversation
    assert conversation is not None
    return conversation.message(role, [text], closed=closed, labels=[f"{tag}.0"], markers_apart=True)


def _exact(window: KameraWindow, query: str) -> None:
    """The window's chunks and its answer to ``query`` (a question of its own) are the model's
    own forward over the whole conversation."""
    chunks = [window.chunk(ref) for ref in window.refs]
    query_ids = window.query_ids(query)
    truth = window.backend.reference_prefill(chunks, query_ids, anchor=window.encoder.anchor())
    for ref, want in zip(window.refs, truth.kv[1:], strict=True):
        got = window.chunk_kv(ref)
        assert rel_err(got.keys, want.keys) < EXACT and rel_err(got.values, want.values) < EXACT, ref
    got_logits = window.ask(query, decode=DecodeConfig(max_new_tokens=1)).first_logits
    assert float((got_logits - truth.logits).abs().max()) < EXACT


@pytest.mark.parametrize(
    ("name", "sent", "same"),
    [("qwen2", "ooooo", 4), ("gemma3", "ooooo", 4), ("qwen2_vl", "ooooo", 4), ("qwen2", "ooxo", 2)],
)
def test_the_next_turn_keeps_the_framing_and_the_answer_the_decode_fed(
    name: str, sent: str, same: int
) -> None:
    """``sent``: the answer as the client sends it back (edited in the last case: the slots are
    kept up to the first token that differs, ``same`` of the answer's)."""
    window = _window(name)
    first = _message(window, "user", PAGE, "u0", closed=False)
    window.arrange(first)
    answer = window.ask("", in_message=True, decode=FIVE_OS)
    assert answer.text == "ooooo" and answer.finish_reason == "length"  # 4 fed back, the last not
    framing = window.query_ids("", in_message=True)
    turn = [
        *_message(window, "user", PAGE, "u0"),
        *_message(window, "assistant", sent, "a0"),
        *_message(window, "user", "and the second page?", "u1", closed=False),
    ]
    target = [*window.refs, *turn[len(first) :]]
    new = sum(chunk.num_tokens for chunk in turn[len(first) :])
    kept = int(framing.shape[0]) + same
    planned = window.plan.arrange(target)
    window.arrange(target)
    cost = window.stats.last
    assert planned.tokens_prefilled == cost.tokens_prefilled == new - kept
    assert cost.tokens_reused == kept and cost.forwards == 1
    _exact(window, "what does item 3 cost?")


def test_a_remembered_answer_is_not_prefilled_again() -> None:
    window = _window("qwen2")
    window.push_message("user", PAGE)
    window.push_message("assistant", "noted")
    question = "what does item 4 cost?"
    asked = window.query_ids(question)
    answer = window.ask(question, decode=FIVE_OS, remember=True)
    cost = window.stats.last  # the op that admitted the question and the answer
    conversation = window.conversation
    assert conversation is not None
    closing = conversation.encoder.tokens(conversation.template.closes["assistant"])
    assert answer.text == "ooooo" and window.last_plan is not None and window.last_plan.op == "extend"
    assert cost.tokens_reused == int(asked.shape[0]) + 4
    assert cost.tokens_prefilled == 1 + int(closing.shape[0])  # the last o, then the closing marker
    _exact(window, "and item 5?")


def test_nothing_is_kept_once_a_chunk_before_the_tail_changed() -> None:
    window = _window("qwen2")
    early = _message(window, "user", "an early note", "u0")
    first = _message(window, "user", PAGE, "u1", closed=False)
    window.arrange([*early, *first])
    answer = window.ask("", in_message=True, decode=FIVE_OS)
    turn = [
        *_message(window, "user", PAGE, "u1"),
        *_message(window, "assistant", answer.text, "a1"),
    ]
    kept_refs = window.refs[len(early) :]  # the early note is dropped: every chunk after it moves
    target = [*kept_refs, *turn[len(first) :]]
    planned = window.plan.arrange(target)
    assert all("last answer" not in edit.detail for edit in planned.edits)
    window.arrange(target)
    assert window.stats.last.tokens_prefilled == planned.tokens_prefilled
    _exact(window, "what does item 3 cost?")


def test_a_dry_run_leaves_the_tail_for_the_op() -> None:
    window = _window("qwen2")
    first = _message(window, "user", PAGE, "u0", closed=False)
    window.arrange(first)
    answer = window.ask("", in_message=True, decode=FIVE_OS)
    assert answer.text == "ooooo"
    closing = _message(window, "user", PAGE, "u0")[len(first) :]
    target = [*window.refs, *closing]
    before = window.plan.arrange(target)
    again = window.plan.arrange(target)
    assert before == again and before.tokens_prefilled == 0  # the closing marker: fed as the query's
    window.arrange(target)
    assert window.stats.last.tokens_prefilled == 0 and window.stats.last.forwards == 0
    _exact(window, "and the total?")


def test_the_cache_records_what_the_decode_fed() -> None:
    window = _window("qwen2")
    window.arrange(_message(window, "user", PAGE, "u0", closed=False))
    window.ask("", in_message=True, decode=FIVE_OS)
    memo = window._runner.state.assembled
    assert memo is not None and memo.tail is not None
    fed = torch.cat([window.query_ids("", in_message=True), torch.tensor([LETTER_O] * 4)])
    assert torch.equal(memo.tail, fed)
