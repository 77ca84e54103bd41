"""Structured output through ``kamera serve`` (issue 33, item 2): ``response_format`` JSON.

On the shipped demo model, which was never trained to write JSON: every answer to a bounded
schema (an enum, an integer, a string with ``maxLength``) parses and validates, and ends
because the document is complete (never ``finish_reason: "length"``), greedy and sampled.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import jsonschema
import openai
import pytest

from tests.serve.conftest import MODEL, LiveServer, shot

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "blue", "green"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["colour", "count", "note"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "reading", "schema": SCHEMA, "strict": True}}


def test_twenty_answers_to_a_bounded_schema_validate_and_end(serve: Callable[..., LiveServer]) -> None:
    live = serve()
    for i in range(20):
        reply = live.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": "Reply in JSON."}, shot(i, "what do you see?")],  # type: ignore[list-item]
            response_format=FORMAT,  # type: ignore[arg-type]
            temperature=0 if i % 2 == 0 else 1.0,
            seed=i,
            max_tokens=64,
        )
        choice = reply.choices[0]
        assert choice.finish_reason != "length", choice
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_a_json_object_is_an_object_and_a_bad_schema_is_refused_by_name(
    serve: Callable[..., LiveServer],
) -> None:
    live = serve()
    reply = live.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Reply in JSON."}, shot(0, "what?")],  # type: ignore[list-item]
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=64,
    )
    if reply.choices[0].finish_reason != "length":  # any object is unbounded: it may not close in 64
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    else:
        assert (reply.choices[0].message.content or "").startswith("{")
    with pytest.raises(openai.BadRequestError, match="response_format"):
        live.client.chat.completions.create(
            model=MODEL,
            messages=[shot(0, "what?")],  # type: ignore[list-item]
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },  # type: ignore[typeddict-item]
        )
