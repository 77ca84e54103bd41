"""The Responses API (issue 33, item 4) through the official client on a live server.

A response, then follow-ups naming it with ``previous_response_id``: each follow-up is its
conversation extended, so the window holds all but the new items; two follow-ups from one
response both succeed and each is served from what the first conversation left cached; a
deleted id is a 404 that says so; fields not served are refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import openai
import pytest

from kamera_agent.config import WindowConfig
from kamera_agent.serve.protocol import RequestError
from kamera_agent.serve.responses import ResponseStore, StoredResponse
from tests.serve.conftest import MODEL, LiveServer, frame_url

Serve = Callable[..., LiveServer]
INSTRUCTIONS = "Answer with one word."


def _screen(i: int, text: str) -> list[dict[str, object]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": frame_url(i)},
                {"type": "input_text", "text": text},
            ],
        }
    ]


def test_a_follow_up_is_served_from_the_conversation_it_extends(serve: Serve) -> None:
    live = serve()
    first = live.client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=_screen(0, "what is shown?"), max_output_tokens=2
    )
    assert first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 0
    branches = []
    for i, question in enumerate(("and now?", "what changed?")):  # two branches from one response
        follow = live.client.responses.create(
            model=MODEL,
            instructions=INSTRUCTIONS,
            previous_response_id=first.id,
            input=_screen(10 + i, question),
            max_output_tokens=2,
        )
        assert follow.usage is not None
        assert follow.usage.input_tokens > first.usage.input_tokens
        branches.append(follow)
    one, two = (b.usage.input_tokens_details.cached_tokens for b in branches)  # type: ignore[union-attr]
    # each branch finds the parent's whole input in the window (its last message was chunks,
    # closed by the question's framing, which the decode fed with the answer): only the answer's
    # tokens the decode did not feed and the branch's items are new
    assert min(one, two) >= first.usage.input_tokens
    assert live.client.responses.retrieve(branches[0].id).id == branches[0].id


def test_a_deleted_or_unknown_id_is_a_404_that_says_so(serve: Serve) -> None:
    live = serve()
    first = live.client.responses.create(model=MODEL, input="hello", max_output_tokens=1)
    live.client.responses.delete(first.id)
    for call in (
        lambda: live.client.responses.retrieve(first.id),
        lambda: live.client.responses.create(
            model=MODEL, previous_response_id=first.id, input="again", max_output_tokens=1
        ),
        lambda: live.client.responses.create(
            model=MODEL, previous_response_id="resp_nonexistent", input="again", max_output_tokens=1
        ),
    ):
        with pytest.raises(openai.NotFoundError, match="deleted, or expired"):
            call()


def test_structured_text_format_and_refusals_by_name(serve: Serve) -> None:
    live = serve()
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    reply = live.client.responses.create(
        model=MODEL,
        input=_screen(3, "which colour?"),  # type: ignore[arg-type]
        text={"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}},
        max_output_tokens=32,
        temperature=0,
    )
    assert json.loads(reply.output_text)["colour"] in ("red", "blue")
    for fields, named in (
        ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
        ({"stream": True, "tool_choice": "required"}, "tool_choice"),
        ({"truncation": "sometimes"}, "truncation"),
    ):
        with pytest.raises(openai.BadRequestError, match=named):
            live.client.responses.create(model=MODEL, input="hi", max_output_tokens=1, **fields)  # type: ignore[call-overload]


def test_a_streamed_response_is_openais_event_sequence_and_equals_the_plain_one(serve: Serve) -> None:
    """Streamed: created, in_progress, the message item and its part opened, a text delta per
    piece, each closed, completed with the whole response (stored: a follow-up extends it),
    its text the deltas' and a plain request's; a forced call streams as a function_call item."""
    live, plain = serve(config=WindowConfig.exact()), serve(config=WindowConfig.exact())
    asked = {"model": MODEL, "instructions": INSTRUCTIONS, "input": _screen(4, "what?"), "temperature": 0}
    events = list(live.client.responses.create(**asked, max_output_tokens=6, stream=True))  # type: ignore[call-overload]
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if events[-1].response.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == events[-4].text
    assert final.output[0].id == events[2].item.id
    assert final.output_text == plain.client.responses.create(**asked, max_output_tokens=6).output_text  # type: ignore[call-overload]
    follow = live.client.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        previous_response_id=final.id,
        input="and?",
        max_output_tokens=1,
    )
    assert follow.usage is not None and follow.usage.input_tokens_details.cached_tokens > 0
    tools = [
        {
            "type": "function",
            "name": "pick",
            "parameters": {
                "type": "object",
                "properties": {"n": {"enum": [1, 2]}},
                "required": ["n"],
                "additionalProperties": False,
            },
        }
    ]
    called = list(
        live.client.responses.create(
            model=MODEL,
            input="pick",
            tools=tools,
            tool_choice="required",
            max_output_tokens=64,
            stream=True,  # type: ignore[arg-type]
        )
    )
    (item,) = [e.item for e in called if e.type == "response.output_item.done"]
    assert item.type == "function_call" and item.name == "pick" and json.loads(item.arguments)["n"] in (1, 2)
    assert called[-1].type == "response.completed" and called[-1].response.output[0].call_id == item.call_id


def test_stored_responses_are_bounded_per_tenant_by_count_and_bytes() -> None:
    """A stored conversation holds its images' data URLs: strangers must not grow the store
    without end. The oldest go first; one over the byte bound is not kept; tenants are apart."""
    store = ResponseStore(per_tenant=10, bytes_per_tenant=10_000)
    page = [{"role": "user", "content": "x" * 3_000}]
    for i in range(5):
        assert store.put(f"a{i}", StoredResponse("a", page, {}))
    store.put("b0", StoredResponse("b", [], {}))
    for gone in ("a0", "a1"):  # 5 of ~3 kB: only the newest 3 fit in 10 kB
        with pytest.raises(RequestError, match="expired"):
            store.get(gone, "a")
    assert [store.get(f"a{i}", "a").tenant for i in (2, 3, 4)] == ["a", "a", "a"]
    assert store.get("b0", "b").tenant == "b"
    assert not store.put("huge", StoredResponse("a", [{"content": "y" * 20_000}], {}))
    with pytest.raises(RequestError, match="expired"):
        store.get("b0", "a")  # another tenant's id reads as unknown
