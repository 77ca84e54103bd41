"""Every request field is served or refused by name, never silently dropped (issue 33, item 3).

A live server on the demo model, driven by the official ``openai`` client: ``logprobs`` and
``top_logprobs`` come back in OpenAI's shape and agree with the answer; ``n`` choices share one
prefill of the prompt; ``logit_bias`` moves the answer; and each field the server does not
serve (``response_format`` JSON, ``tools``, an unknown field, an ignored field with a value it
cannot ignore) is a 400 naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.serve.protocol import IGNORED
from kamera_agent.window import KameraWindow
from tests.serve.conftest import MODEL, LiveServer, shot

Serve = Callable[..., LiveServer]
SYSTEM = {"role": "system", "content": "Answer with one word."}
MESSAGES = [SYSTEM, shot(0, "what colour?")]


def _refusal(call: Callable[[], Any]) -> tuple[int, dict[str, Any]]:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    body = info.value.body
    assert isinstance(body, dict)
    return info.value.status_code, body


def test_logprobs_come_back_in_openais_shape_and_agree_with_the_answer(serve: Serve) -> None:
    live = serve()
    reply = live.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=3, logprobs=True, top_logprobs=5
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-6)
        assert entry.bytes == list(entry.token.encode())
    plain = live.client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=3)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


def test_streamed_logprobs_arrive_before_the_finish(serve: Serve) -> None:
    live = serve()
    stream = live.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=3, logprobs=True, stream=True
    )
    text, entries = "", []
    for event in stream:
        for choice in event.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                entries += choice.logprobs.content
    assert entries and "".join(entry.token for entry in entries) == text


def test_n_choices_share_one_prefill_of_the_prompt(serve: Serve) -> None:
    live = serve()
    three = live.client.chat.completions.create(
        model=MODEL, messages=[SYSTEM, shot(2, "what?")], temperature=1.0, seed=3, max_tokens=4, n=3
    )
    assert [choice.index for choice in three.choices] == [0, 1, 2]
    ops = three.model_extra["kamera"]["ops"]  # type: ignore[index]
    arrange, asks = [op for op in ops if op["op"] != "ask"], [op for op in ops if op["op"] == "ask"]
    assert len(arrange) == 1 and len(asks) == 3  # the prompt once, then three samples
    assert all(op["tokens_prefilled"] < arrange[0]["tokens_prefilled"] for op in asks)
    assert 0 < three.usage.completion_tokens <= 3 * 4  # type: ignore[union-attr]
    again = live.client.chat.completions.create(
        model=MODEL, messages=[SYSTEM, shot(2, "what?")], temperature=1.0, seed=3, max_tokens=4, n=3
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in three.choices]


def test_a_requests_decode_settings_are_built_once_and_each_choice_derived(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One `DecodeConfig` per request, checked once; choice ``i`` samples with seed ``seed + i``."""
    live = serve()
    built: list[DecodeConfig] = []
    check, ask = DecodeConfig.__post_init__, KameraWindow.ask
    asked: list[DecodeConfig | None] = []

    def counted(config: DecodeConfig) -> None:
        built.append(config)
        check(config)

    def recorded(window: KameraWindow, query: str, **keywords: Any) -> Any:
        asked.append(keywords.get("decode"))
        return ask(window, query, **keywords)

    monkeypatch.setattr(DecodeConfig, "__post_init__", counted)
    monkeypatch.setattr(KameraWindow, "ask", recorded)
    live.client.chat.completions.create(
        model=MODEL, messages=[SYSTEM, shot(3, "what?")], temperature=1.0, seed=3, max_tokens=2, n=3, stop="."
    )
    assert len(built) == 1 and built[0].stop == (".",) and built[0].max_new_tokens == 2
    assert [decode.seed for decode in asked if decode is not None] == [3, 4, 5] and len(asked) == 3


def test_a_logit_bias_moves_the_answer(serve: Serve) -> None:
    live = serve()
    plain = live.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=1, logprobs=True, top_logprobs=2
    )
    first = plain.choices[0].logprobs.content[0]  # type: ignore[union-attr, index]
    token_id = live.server.backend.encoder.tokenizer.convert_tokens_to_ids(first.token)
    if (
        not isinstance(token_id, int)
        or live.server.backend.encoder.tokenizer.decode([token_id]) != first.token
    ):
        token_id = live.server.backend.encoder.tokenizer(first.token, add_special_tokens=False)["input_ids"][
            0
        ]
    banned = live.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=1, logit_bias={str(token_id): -100}
    )
    assert banned.choices[0].message.content == first.top_logprobs[1].token  # the runner-up


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "click"}}],
                "tool_choice": {"type": "function", "function": {"name": "scroll"}},
            },
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "click"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"extra_body": {"reasoning_effort": "high"}}, "reasoning_effort"),
        ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
        ({"extra_body": {"store": True}}, "store"),
        ({"extra_body": {"service_tier": "flex"}}, "service_tier"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"n": 2, "stream": True}, "n"),
        ({"n": 99}, "n"),
        ({"extra_body": {"continue_final_message": True}}, "add_generation_prompt"),
        ({"extra_body": {"add_generation_prompt": False}}, "add_generation_prompt"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "click"}}],
                "extra_body": {"continue_final_message": True, "add_generation_prompt": False},
            },
            "continue_final_message",
        ),
        (  # the last message is the user's: nothing to continue
            {"extra_body": {"continue_final_message": True, "add_generation_prompt": False}},
            "messages",
        ),
    ],
)
def test_an_unserved_field_is_a_400_that_names_it(serve: Serve, fields: dict[str, Any], named: str) -> None:
    live = serve()
    status, body = _refusal(
        lambda: live.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **fields)
    )
    assert status == 400 and named in (body.get("param") or "") + body["message"], body


def test_ignored_fields_are_documented_and_accepted(serve: Serve) -> None:
    live = serve()
    reply = live.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=1,
        metadata={"run": "test"},
        store=False,
        service_tier="auto",
        extra_body={"modalities": ["text"]},
    )
    assert reply.choices[0].message.content is not None
    serve_md = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text()
    for name in IGNORED:
        assert f"`{name}`" in serve_md, f"docs/serve.md does not list the ignored field {name}"


def test_an_answer_continues_the_final_assistant_message_as_the_models_own_forward_does(
    serve: Serve, demo_backend: Any
) -> None:
    """vLLM's ``continue_final_message``: the prompt is the template's rendering up to the final
    message's text (no end of message), and the answer is the model's greedy continuation."""
    live = serve()
    messages = [
        SYSTEM,
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The"},
    ]
    continued = {"continue_final_message": True, "add_generation_prompt": False}
    reply = live.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=3,
        extra_body=continued,  # type: ignore[arg-type]
    )
    tokenizer, model = demo_backend.encoder.tokenizer, demo_backend.model
    prompt = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\nThe")
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    made = model.generate(ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1] :]
    assert reply.choices[0].message.content == tokenizer.decode(made, skip_special_tokens=True)
    assert reply.usage is not None and reply.usage.prompt_tokens == ids.shape[1]
    opened = live.client.chat.completions.create(
        model=MODEL, messages=messages[:2], temperature=0, max_tokens=3
    )
    assert reply.choices[0].message.content != opened.choices[0].message.content  # the opening counts
