"""A conversation's newest message is prefilled once: the next turn finds it in the window.

Why: a request's last message used to be its question, prefilled over the window and dropped
after the answer, so the next turn (which resends it as history) prefilled it again: every
screen and tool output of an agent's loop twice, where a prefix cache (vLLM's, SGLang's) keeps
the prompt it computed and prefills it once. The last message is now chunks of an open message
that the question's framing closes; that framing and the answer are what the decode fed after
it, kept in the window's cache for the next turn (`kamera_agent.window.tail`), so the next turn
reuses the whole last prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.serve.conftest import MODEL, LiveServer, shot

Serve = Callable[..., LiveServer]
SYSTEM = {"role": "system", "content": "Answer briefly."}


def _page(i: int) -> str:
    return " ".join(f"line {i}.{j}: a button labelled option {j}" for j in range(24))


@pytest.mark.parametrize("reuse", ["kamera", "prefix"])
def test_each_turn_prefills_only_what_the_last_did_not_send(serve: Serve, reuse: str) -> None:
    live = serve(reuse=reuse)
    history: list[dict[str, Any]] = []
    last_prompt = 0
    for i in range(4):
        tool_turn = i % 2 == 1  # a text page, or a screenshot with its text
        message = {"role": "user", "content": _page(i)} if tool_turn else shot(i, _page(i))
        reply = live.client.chat.completions.create(
            model=MODEL,
            messages=[SYSTEM, *history, message],
            temperature=0,  # type: ignore[list-item]
        )
        usage = reply.usage
        assert usage is not None
        cached = usage.prompt_tokens_details.cached_tokens
        if i:  # the last prompt reused, its question's framing included (the decode fed it)
            assert cached >= last_prompt, (i, cached, last_prompt)
        assert usage.prompt_tokens - cached > 24 * 8  # this turn's page, prefilled
        last_prompt = usage.prompt_tokens
        history += [message, {"role": "assistant", "content": reply.choices[0].message.content or "."}]
