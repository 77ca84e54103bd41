"""Tool-call formats by template family (issue 33, item 1): a Llama 3.1-style template gets
Llama's bare JSON calls (``{"name": …, "parameters": …}``, results in the ``ipython`` role),
chosen from the template, rendered as the template renders them, parsed back, streamed, and
forced by the grammar; Qwen/ChatML templates keep Hermes' ``<tool_call>`` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.config import WindowConfig
from kamera_agent.models.random_qwen2 import Qwen2Shape, random_qwen2
from kamera_agent.models.tiny_tokenizer import build_byte_tokenizer
from kamera_agent.serve import KameraServer, ServeSettings
from kamera_agent.serve.tools import HERMES, LLAMA3_JSON, CallFilter, system_with_tools, tool_format_for
from kamera_agent.serve.turns import read_turns
from tests.serve.conftest import LiveServer
from tests.templates import LLAMA_STYLE, SPECIALS

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "click",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
                "additionalProperties": False,
            },
        },
    }
]
MODEL = "tiny-llama-style"


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    tokenizer = build_byte_tokenizer(SPECIALS, LLAMA_STYLE, vocab_size=512)
    tokenizer.eos_token = "<|eot_id|>"
    shape = Qwen2Shape(layers=4, hidden=64, heads=4, kv_heads=2, mlp=128, vocab=512)
    model = random_qwen2(shape, seed=3, max_positions=4096)
    model.generation_config.eos_token_id = SPECIALS["<|eot_id|>"]
    return TransformersBackend(model, tokenizer=tokenizer)


@pytest.fixture
def live(backend: TransformersBackend) -> Iterator[LiveServer]:
    server = LiveServer(KameraServer(backend, ServeSettings(MODEL, WindowConfig.exact(), max_tokens=48)))
    yield server
    server.stop()


def _conversation() -> list[dict[str, Any]]:
    call = {"id": "call_0", "type": "function", "function": {"name": "click", "arguments": '{"x": 3}'}}
    return [
        {"role": "system", "content": "You click."},
        {"role": "user", "content": "open the menu"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "the menu is open"},
    ]


def test_the_format_is_chosen_from_the_template(backend: TransformersBackend) -> None:
    from kamera_agent.demo.model import demo_tokenizer

    assert tool_format_for(backend.encoder.tokenizer) is LLAMA3_JSON
    assert tool_format_for(demo_tokenizer()) is HERMES


def test_a_llama_tool_conversation_is_framed_as_its_template_renders_it(backend: TransformersBackend) -> None:
    server = KameraServer(backend, ServeSettings(MODEL, WindowConfig(), max_tokens=2))
    assert server.tool_format is LLAMA3_JSON
    tokenizer = backend.encoder.tokenizer
    messages = _conversation()
    system, turns = read_turns(messages, tool_format=LLAMA3_JSON)
    framed = system_with_tools(tokenizer, server.messages.template, system, TOOLS)
    prepared = server.messages.prepare(framed, turns, server.pixels.lease("default"))
    conversation = server.messages.conversation(framed)
    ids = [conversation.encoder.anchor().input_ids, *(chunk.input_ids for chunk in prepared.chunks)]
    ids.append(conversation.query_ids("", opened=False, role=prepared.role))
    for message in messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    want = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False, tools_in_user_message=False
    )
    assert tokenizer.decode(torch.cat(ids)) == want


def test_llama_calls_parse_back_and_plain_text_stays_text() -> None:
    content, calls = LLAMA3_JSON.parse('<|python_tag|>{"name": "click", "parameters": {"x": 1}}')
    assert content is None and calls[0]["function"]["name"] == "click"
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    _, two = LLAMA3_JSON.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}')
    assert [c["function"]["name"] for c in two] == ["a", "b"]
    assert LLAMA3_JSON.parse("I would click {here}.") == ("I would click {here}.", [])
    assert LLAMA3_JSON.render(None, [{"function": {"name": "click", "arguments": '{"x": 1}'}}]) == (
        '{"name": "click", "parameters": {"x": 1}}'
    )
    sent: list[str] = []
    plain = CallFilter(sent.append, LLAMA3_JSON)
    for piece in (" I", " would", " click."):
        plain(piece)
    assert "".join(sent) == " I would click."  # plain text streams as it comes
    held: list[str] = []
    calling = CallFilter(held.append, LLAMA3_JSON)
    for piece in ('{"na', 'me": "click"', "}"):
        calling(piece)
    assert held == []  # a call is never streamed as text


def test_a_required_call_on_a_llama_template_is_a_bare_json_call(live: LiveServer) -> None:
    for stream in (False, True):
        asked = {
            "model": MODEL,
            "messages": _conversation(),
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "temperature": 0,
            "max_tokens": 48,
        }
        if stream:
            calls, text, finish = [], "", None
            for event in live.client.chat.completions.create(**asked, stream=True):  # type: ignore[call-overload]
                for choice in event.choices:
                    text += choice.delta.content or ""
                    calls += choice.delta.tool_calls or []
                    finish = choice.finish_reason or finish
            assert text == "" and finish == "tool_calls"
        else:
            reply = live.client.chat.completions.create(**asked)  # type: ignore[call-overload]
            assert reply.choices[0].finish_reason == "tool_calls"
            calls = reply.choices[0].message.tool_calls or []
        (call,) = calls
        assert call.function.name == "click"  # type: ignore[union-attr]
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])  # type: ignore[union-attr]
