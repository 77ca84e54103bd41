"""Tools through ``kamera serve`` (issue 33, item 1), with the official client on loopback.

Two halves: the wire path with a backend that answers a given completion (the demo model does
not call tools), checking that Hermes-style calls come back as ``message.tool_calls``, plain and
streamed; and the real demo model, whose template renders tools, through a tool-using
conversation that truncates old tool outputs: every message (definitions, calls, results) is
framed exactly as the model's template renders it, every turn after the first is served from
cache, and under the exact preset every answer equals a fresh server's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import jsonschema
import pytest
import torch

from kamera_agent.backends.base import Backend, DecodeConfig, Decoded
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.config import WindowConfig
from kamera_agent.serve import KameraServer, ServeSettings
from kamera_agent.serve.tools import HERMES, system_with_tools
from kamera_agent.serve.turns import read_turns
from kamera_agent.testing import CountingBackend
from tests.serve.conftest import MODEL, LiveServer, shot

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "click",
            "description": "Click at a point of the screen.",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            },
        },
    },
    {"type": "function", "function": {"name": "type_text", "parameters": {"type": "object"}}},
]
SYSTEM = {"role": "system", "content": "You operate a computer."}
CLICK = '<tool_call>\n{"name": "click", "arguments": {"x": 3, "y": 4}}\n</tool_call>'
TYPE = '<tool_call>\n{"name": "type_text", "arguments": {"text": "hi"}}\n</tool_call>'


class ScriptedBackend(CountingBackend):
    """The demo model, except that each answer is the next scripted completion (streamed in
    pieces of three characters): the wire path sees what a tool-calling model would emit."""

    def __init__(self, inner: Backend, replies: list[str]) -> None:
        super().__init__(inner)
        self.replies = list(replies)

    def decode(self, cache: Any, query_ids: Any, start: int, config: DecodeConfig) -> Decoded:
        done: Decoded = self.inner.decode(
            cache, query_ids, start, replace(config, max_new_tokens=1, on_text=None)
        )
        text = self.replies.pop(0)
        if config.on_text is not None:
            for i in range(0, len(text), 3):
                config.on_text(text[i : i + 3])
        tokens = self.encoder.tokenizer(text, add_special_tokens=False)["input_ids"]
        return replace(done, answer=replace(done.answer, text=text, tokens=tokens, finish_reason="eos"))


@pytest.fixture
def scripted(demo_backend: TransformersBackend) -> Iterator[Callable[[list[str]], LiveServer]]:
    started: list[LiveServer] = []

    def start(replies: list[str]) -> LiveServer:
        backend = ScriptedBackend(demo_backend, replies)
        live = LiveServer(KameraServer(backend, ServeSettings(MODEL, WindowConfig(), max_tokens=64)))
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


def test_a_tool_call_comes_back_as_tool_calls(scripted: Callable[[list[str]], LiveServer]) -> None:
    live = scripted([CLICK, "I will click. " + CLICK + "\n" + TYPE, CLICK + "\n" + TYPE])
    messages = [SYSTEM, shot(0, "open the menu")]
    reply = live.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "click"
    assert json.loads(call.function.arguments) == {"x": 3, "y": 4}
    two = live.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert two.choices[0].message.content == "I will click."
    assert [c.function.name for c in two.choices[0].message.tool_calls or []] == ["click", "type_text"]
    one = live.client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        parallel_tool_calls=False,
    )
    assert [c.function.name for c in one.choices[0].message.tool_calls or []] == ["click"]


def test_a_streamed_tool_call_never_shows_as_text(scripted: Callable[[list[str]], LiveServer]) -> None:
    live = scripted(["Opening it now. " + CLICK])
    stream = live.client.chat.completions.create(
        model=MODEL,
        messages=[SYSTEM, shot(1, "open the menu")],  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        stream=True,
    )
    text, calls, finish = "", [], None
    for event in stream:
        for choice in event.choices:
            text += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert text.strip() == "Opening it now." and "<tool" not in text
    assert [c.function.name for c in calls] == ["click"] and finish == "tool_calls"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"x": 3, "y": 4}  # type: ignore[union-attr]


def test_without_tools_or_with_tool_choice_none_the_answer_stays_text(
    scripted: Callable[[list[str]], LiveServer],
) -> None:
    live = scripted([CLICK, CLICK])
    plain = live.client.chat.completions.create(model=MODEL, messages=[SYSTEM, shot(2, "what?")])  # type: ignore[arg-type]
    assert plain.choices[0].message.content == CLICK and not plain.choices[0].message.tool_calls
    none = live.client.chat.completions.create(
        model=MODEL,
        messages=[SYSTEM, shot(2, "what?")],  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
    )
    assert none.choices[0].finish_reason == "stop" and not none.choices[0].message.tool_calls


def _history(turns: int, keep_outputs: int) -> Iterator[list[dict[str, Any]]]:
    """A tool-using agent's requests: each turn a screenshot and a question, the model's call,
    the tool's (long) output; outputs older than ``keep_outputs`` turns truncated to a stub."""
    history: list[dict[str, Any]] = [SYSTEM]
    for turn in range(turns):
        yield [*history, shot(turn, f"step {turn}: what next?")]
        call = {
            "id": f"call_{turn}",
            "type": "function",
            "function": {"name": "click", "arguments": json.dumps({"x": turn, "y": 2 * turn})},
        }
        history += [
            shot(turn, f"step {turn}: what next?"),
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": f"call_{turn}",
                "content": f"clicked; the page now shows item {turn} " * 6,
            },
        ]
        for message in history[: -3 * keep_outputs]:
            if message["role"] == "tool":
                message["content"] = "(output dropped)"


def _agent_loop(turns: int, keep_outputs: int) -> Iterator[list[dict[str, Any]]]:
    """An agent's requests after its task: each ends in the output of the tool the model called
    (the model answers the output), outputs older than ``keep_outputs`` turns truncated."""
    history: list[dict[str, Any]] = [SYSTEM, shot(0, "book a table for two")]
    for turn in range(turns):
        call = {
            "id": f"call_{turn}",
            "type": "function",
            "function": {"name": "click", "arguments": json.dumps({"x": turn, "y": 1})},
        }
        history += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"page {turn}: a form " * 8},
        ]
        for message in history[: -2 * keep_outputs]:
            if message["role"] == "tool":
                message["content"] = "(output dropped)"
        yield [dict(message) for message in history]


@pytest.mark.parametrize("ending", ["user", "tool"])
def test_a_tool_conversation_is_framed_as_the_template_renders_it(
    demo_backend: TransformersBackend, ending: str
) -> None:
    server = KameraServer(demo_backend, ServeSettings(MODEL, WindowConfig(), max_tokens=2))
    requests = _history(3, keep_outputs=1) if ending == "user" else _agent_loop(3, keep_outputs=1)
    messages = list(requests)[-1]
    assert messages[-1]["role"] == ending
    tokenizer = demo_backend.encoder.tokenizer
    system, turns = read_turns(messages, tool_format=HERMES)
    framed = system_with_tools(tokenizer, server.messages.template, system, TOOLS)
    prepared = server.messages.prepare(framed, turns, server.pixels.lease("default"))
    conversation = server.messages.conversation(framed)
    ids = [conversation.encoder.anchor().input_ids, *(chunk.input_ids for chunk in prepared.chunks)]
    ids.append(conversation.query_ids("", opened=False, role=prepared.role))
    ours = tokenizer.decode(torch.cat(ids))
    while "<|image_pad|><|image_pad|>" in ours:
        ours = ours.replace("<|image_pad|><|image_pad|>", "<|image_pad|>")
    for message in messages:  # the template renders images as one placeholder, calls from objects
        if isinstance(message.get("content"), list):
            message["content"] = [
                {"type": "image"} if part["type"] == "image_url" else part for part in message["content"]
            ]
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    want = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ours == want


def test_a_tool_conversation_truncating_old_outputs_is_served_from_cache_and_exact(
    serve: Callable[..., LiveServer],
) -> None:
    live, fresh = serve(config=WindowConfig.exact()), serve(config=WindowConfig.exact())
    for turn, messages in enumerate(_history(10, keep_outputs=2)):
        reply = live.client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=2,
            extra_body={"session_id": "agent"},
        )
        cold = fresh.client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=2,
            extra_body={"session_id": f"cold-{turn}"},
        )
        cached = reply.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
        assert turn == 0 or cached > 0, turn
        assert reply.choices[0].message.content == cold.choices[0].message.content, turn
        assert reply.usage.prompt_tokens == cold.usage.prompt_tokens  # type: ignore[union-attr]


def test_an_agent_loop_ending_in_tool_outputs_is_served_from_cache_and_exact(
    serve: Callable[..., LiveServer],
) -> None:
    """Each request ends in a tool's output (no user message after it): the output is the
    question the model answers; the truncated outputs are evicts, and answers equal a cold
    server's under the exact preset."""
    live, fresh = serve(config=WindowConfig.exact()), serve(config=WindowConfig.exact())
    for turn, messages in enumerate(_agent_loop(8, keep_outputs=2)):
        asked = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 3}
        reply = live.client.chat.completions.create(**asked, extra_body={"session_id": "agent"})  # type: ignore[call-overload]
        cold = fresh.client.chat.completions.create(**asked, extra_body={"session_id": f"cold-{turn}"})  # type: ignore[call-overload]
        assert reply.choices[0].message.content == cold.choices[0].message.content, turn
        assert reply.usage.prompt_tokens == cold.usage.prompt_tokens, turn
        assert turn == 0 or reply.usage.prompt_tokens_details.cached_tokens > 0, turn


def test_the_hermes_format_parses_what_it_renders_and_leaves_malformed_calls_as_text() -> None:
    calls = [{"type": "function", "function": {"name": "click", "arguments": '{"x": 1}'}}]
    text = HERMES.render("ok", calls)
    assert text == 'ok\n<tool_call>\n{"name": "click", "arguments": {"x": 1}}\n</tool_call>'
    content, parsed = HERMES.parse(text)
    assert content == "ok" and parsed[0]["function"] == {"name": "click", "arguments": '{"x": 1}'}
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert HERMES.parse(broken) == (broken, [])
    nameless = '<tool_call>\n{"arguments": {}}\n</tool_call>'
    assert HERMES.parse(nameless) == (nameless, [])
    assert HERMES.parse("<tool_call> never closed") == ("<tool_call> never closed", [])


def test_the_demo_template_renders_tools_and_otherwise_exactly_qwen2_vls(
    demo_backend: TransformersBackend,
) -> None:
    from kamera_agent.demo.model import DEMO_CHAT_TEMPLATE
    from kamera_agent.models.tiny_tokenizer import QWEN2_VL_CHAT_TEMPLATE

    tokenizer = demo_backend.encoder.tokenizer
    assert tokenizer.chat_template == DEMO_CHAT_TEMPLATE  # the shipped checkpoint's file is this one
    qwen2_vl = QWEN2_VL_CHAT_TEMPLATE.replace("You are a helpful assistant.", "Answer briefly.")
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "yes"},
        {"role": "tool", "content": "done"},
        {"role": "user", "content": "and?"},
    ]
    for conversation in (messages, [SYSTEM, *messages]):
        ours = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        theirs = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False, chat_template=qwen2_vl
        )
        assert ours == theirs
    with_tools = tokenizer.apply_chat_template([SYSTEM, *messages], tools=TOOLS, tokenize=False)
    assert "<tools>\n" + json.dumps(TOOLS[0]) in with_tools


BOUNDED = [  # parameter schemas a forced call can always complete within a few dozen tokens
    {
        "type": "function",
        "function": {
            "name": "click",
            "parameters": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 99},
                    "y": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "type_text",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "maxLength": 8}},
                "required": ["text"],
                "additionalProperties": False,
            },
        },
    },
]
_SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in BOUNDED}


def _valid_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.function.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), _SCHEMAS[call.function.name])


def test_a_required_or_named_call_on_the_demo_model_is_a_call_that_validates(
    serve: Callable[..., LiveServer],
) -> None:
    """The demo model never learned to call tools: with ``tool_choice`` ``required`` or a named
    function the grammar makes every answer a call of an allowed function whose arguments
    validate, ended by the grammar (never cut by ``max_tokens``)."""
    live = serve()
    named = {"type": "function", "function": {"name": "type_text"}}
    for i in range(12):
        choice_of = "required" if i % 2 == 0 else named
        reply = live.client.chat.completions.create(
            model=MODEL,
            messages=[SYSTEM, shot(i, "what next?")],  # type: ignore[list-item]
            tools=BOUNDED,  # type: ignore[arg-type]
            tool_choice=choice_of,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            temperature=0 if i % 4 < 2 else 1.0,
            seed=i,
            max_tokens=200,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        calls = choice.message.tool_calls or []
        assert len(calls) == 1
        _valid_calls(calls, {"click", "type_text"} if choice_of == "required" else {"type_text"})


def test_a_required_call_streams_as_tool_calls_and_parallel_calls_each_validate(
    serve: Callable[..., LiveServer],
) -> None:
    live = serve()
    stream = live.client.chat.completions.create(
        model=MODEL,
        messages=[SYSTEM, shot(3, "what next?")],  # type: ignore[list-item]
        tools=BOUNDED,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
        stream=True,
    )
    text, calls, finish = "", [], None
    for event in stream:
        for choice in event.choices:
            text += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert text == "" and finish == "tool_calls"
    _valid_calls(calls, {"click", "type_text"})
    several = live.client.chat.completions.create(
        model=MODEL,
        messages=[SYSTEM, shot(4, "what next?")],  # type: ignore[list-item]
        tools=BOUNDED,  # type: ignore[arg-type]
        tool_choice="required",
        temperature=0,
        max_tokens=300,
    )
    _valid_calls(several.choices[0].message.tool_calls or [], {"click", "type_text"})  # type: ignore[arg-type]


def test_a_named_function_in_the_responses_shape_is_called(serve: Callable[..., LiveServer]) -> None:
    live = serve()
    response = live.client.responses.create(
        model=MODEL,
        input="fill the form",
        tools=[{"type": "function", **tool["function"]} for tool in BOUNDED],  # type: ignore[misc]
        tool_choice={"type": "function", "name": "click"},
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=200,
    )
    (item,) = response.output
    assert item.type == "function_call" and item.name == "click"
    jsonschema.validate(json.loads(item.arguments), _SCHEMAS["click"])
    answered = live.client.responses.create(  # the agent runs the call and sends its output back
        model=MODEL,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "clicked: a form opened"}],
        tools=[{"type": "function", **tool["function"]} for tool in BOUNDED],  # type: ignore[misc]
        temperature=0,
        max_output_tokens=3,
    )
    assert answered.status in ("completed", "incomplete") and answered.usage is not None
    assert answered.usage.input_tokens_details.cached_tokens > 0  # the call's conversation was kept
