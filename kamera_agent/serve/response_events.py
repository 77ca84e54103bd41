"""A streamed Responses API answer: OpenAI's event sequence over one `Feed`.

Why its own module: the Responses API streams typed events (``response.created``, the output
item and its content part opened, ``response.output_text.delta`` per piece, each closed again,
function calls as items with their arguments, ``response.completed`` with the whole response),
not chat-completion chunks; the official client rebuilds typed objects from them, so the shape
and the ids must match the final response exactly.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from kamera_agent.serve.feed import Feed
from kamera_agent.serve.responses import ResponseRequest, to_response

__all__ = ["response_events"]


async def response_events(
    feed: Feed,
    first: tuple[str, Any],
    request: ResponseRequest,
    response_id: str,
    finished: Callable[[Any, dict[str, Any], dict[str, Any]], None],
) -> AsyncIterator[bytes]:
    """The SSE bytes of one streamed response; ``finished(done, body, message)`` is called
    with the served completion before ``response.completed`` (it stores the response)."""
    sequence = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    shell = _shell(request, response_id)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    where = {"item_id": message_id, "output_index": 0, "content_index": 0}
    text, opened = "", False
    try:
        yield event("response.created", response=shell)
        yield event("response.in_progress", response=shell)
        kind, value = first
        while kind == "text":
            if not opened:  # the message item opens with the first text
                opened = True
                item = {"type": "message", "id": message_id, "status": "in_progress", "role": "assistant"}
                yield event("response.output_item.added", output_index=0, item={**item, "content": []})
                yield event("response.content_part.added", part=_part(""), **where)
            text += value
            yield event("response.output_text.delta", delta=value, logprobs=[], **where)
            kind, value = await feed.next()
        if kind == "refused":
            yield event("error", **value.body("server_error")["error"])
            return
        body, message = to_response(value, request, response_id, message_id=message_id)
        finished(value, body, message)
        output = list(body["output"])
        if opened:
            said = output[0]["content"][0]["text"] if output and output[0]["type"] == "message" else text
            yield event("response.output_text.done", text=said, logprobs=[], **where)
            yield event("response.content_part.done", part=_part(said), **where)
            if output and output[0]["type"] == "message":
                yield event("response.output_item.done", output_index=0, item=output[0])
        calls = [item for item in output if item["type"] == "function_call"]
        start = len(output) - len(calls)
        for index, call in enumerate(calls, start=start):
            added = {**call, "arguments": "", "status": "in_progress"}
            yield event("response.output_item.added", output_index=index, item=added)
            done = {"item_id": call["id"], "output_index": index}
            yield event("response.function_call_arguments.delta", delta=call["arguments"], **done)
            yield event("response.function_call_arguments.done", arguments=call["arguments"], **done)
            yield event("response.output_item.done", output_index=index, item=call)
        yield event(
            f"response.{'incomplete' if body['status'] == 'incomplete' else 'completed'}", response=body
        )
    finally:
        feed.cancel()


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _shell(request: ResponseRequest, response_id: str) -> dict[str, Any]:
    """The response as it stands before any output (what ``response.created`` carries)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": 0,
        "status": "in_progress",
        "model": request.model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [],
        "previous_response_id": request.previous_response_id,
        "instructions": request.instructions,
        "error": None,
        "incomplete_details": None,
        "metadata": request.metadata or {},
        "text": request.text or {"format": {"type": "text"}},
        "truncation": request.truncation or "disabled",
    }
