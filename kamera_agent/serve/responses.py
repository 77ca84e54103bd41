"""OpenAI's Responses API over `KameraServer`: ``POST/GET/DELETE /v1/responses``.

Why a translation: a response request is a conversation said another way: ``instructions`` are
the system prompt, ``input`` items are messages (text and images), function calls and their
outputs, and ``previous_response_id`` means "the conversation that response ended, then this".
So each request becomes the chat request of its whole conversation and is served by the same
window machinery: a follow-up's conversation extends its previous one, so the session's window
already holds all but the new items, and two follow-ups from one response each pay only their
own new items (the window moves between the branches by `arrange`).

Stored responses (``store``, default true as OpenAI's) keep their conversation and output so a
follow-up can name them; they are bounded per tenant by count, the oldest dropped first, and
belong to their tenant alone: another tenant's id, an expired or a deleted one is a 404 that
says so. Fields are served or refused by name, as in chat completions.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kamera_agent.serve.protocol import ChatRequest, RequestError

__all__ = [
    "ResponseRequest",
    "ResponseStore",
    "StoredResponse",
    "to_chat",
    "to_response",
]


class ResponseRequest(BaseModel):
    """``POST /v1/responses``: the fields served (any other is refused by name)."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, max_length=128)
    store: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    truncation: str | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    user: str | None = Field(default=None, max_length=256)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def refuse_unsupported(self) -> None:
        for name in sorted(self.model_extra or {}):
            raise RequestError(
                400, f"{name!r} is not a field kamera serve takes for responses; remove it", param=name
            )
        if self.truncation not in (None, "disabled", "auto"):
            raise RequestError(
                400, f"truncation {self.truncation!r}: 'auto' or 'disabled'", param="truncation"
            )
        if self.service_tier not in (None, "auto", "default"):
            raise RequestError(400, f"service_tier={self.service_tier!r} is not served", param="service_tier")


@dataclass
class StoredResponse:
    """A stored response: its tenant, the conversation it ended (chat messages without the
    system one, its output included) and the object returned."""

    tenant: str
    messages: list[dict[str, Any]]
    body: dict[str, Any]


class ResponseStore:
    """Stored responses by id, per tenant bounded by count and by bytes (a stored conversation
    holds its images' data URLs: a stranger's requests must not grow the server without end);
    the oldest are dropped first, and a response larger than the byte bound is not stored.
    Thread-safe."""

    def __init__(self, per_tenant: int = 256, bytes_per_tenant: int = 64 << 20) -> None:
        self.per_tenant, self.bytes_per_tenant = per_tenant, bytes_per_tenant
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Store ``stored`` (dropping the tenant's oldest to fit); ``False`` when it alone is over
        the byte bound and was not stored."""
        size = len(json.dumps(stored.messages)) + len(json.dumps(stored.body))
        if size > self.bytes_per_tenant:
            return False
        with self._lock:
            self._items[response_id] = (stored, size)
            own = [(rid, n) for rid, (item, n) in self._items.items() if item.tenant == stored.tenant]
            total = sum(n for _, n in own)
            for i, (rid, n) in enumerate(own[:-1]):
                if len(own) - i <= self.per_tenant and total <= self.bytes_per_tenant:
                    break
                del self._items[rid]
                total -= n
        return True

    def get(self, response_id: str, tenant: str) -> StoredResponse:
        with self._lock:
            held = self._items.get(response_id)
        stored = None if held is None else held[0]
        if stored is None or stored.tenant != tenant:
            raise RequestError(
                404,
                f"no stored response {response_id[:64]!r}: never stored, deleted, or expired (the oldest "
                f"are dropped past {self.per_tenant} or {self.bytes_per_tenant >> 20} MiB per key)",
                param="previous_response_id",
                code="response_not_found",
            )
        return stored

    def delete(self, response_id: str, tenant: str) -> None:
        self.get(response_id, tenant)
        with self._lock:
            self._items.pop(response_id, None)


def to_chat(
    request: ResponseRequest, previous: StoredResponse | None, max_messages: int
) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The chat request of the whole conversation, and its messages without the system one.

    Raises:
        RequestError: an input item that is not served.
    """
    history = list(previous.messages) if previous is not None else []
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
    for i, item in enumerate(items):
        history += _item(item, f"input[{i}]")
    if request.truncation == "auto" and len(history) > max_messages:  # the oldest items slide out
        history = history[-max_messages:]
        while history and history[0]["role"] == "tool":
            history = history[1:]
    instructions = request.instructions  # as OpenAI's: never carried over from the previous response
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    tools = [_tool(tool, i) for i, tool in enumerate(request.tools or [])] or None
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_tokens": request.max_output_tokens,
        "tools": tools,
        "tool_choice": _tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "prompt_cache_key": request.prompt_cache_key,
        "user": request.user,
    }
    if request.text and "format" in request.text:
        body["response_format"] = _format(request.text["format"])
    return ChatRequest.model_validate({k: v for k, v in body.items() if v is not None}), history


def _item(item: dict[str, Any], where: str) -> list[dict[str, Any]]:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role", "user")
        content = item.get("content")
        if isinstance(content, list):
            content = [_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
        return [{"role": "system" if role == "developer" else role, "content": content}]
    if kind == "function_call":
        call = {"id": item.get("call_id", ""), "type": "function"}
        call["function"] = {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output", "")
        return [
            {
                "role": "tool",
                "tool_call_id": item.get("call_id", ""),
                "content": output if isinstance(output, str) else json.dumps(output),
            }
        ]
    raise RequestError(400, f"{where}: input item type {str(kind)[:40]!r} is not served", param="input")


def _part(part: dict[str, Any], where: str) -> dict[str, Any]:
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise RequestError(
                400, f"{where}: input_image needs an image_url (file_id is not served)", param="input"
            )
        return {"type": "image_url", "image_url": {"url": url}}
    raise RequestError(400, f"{where}: content part type {str(kind)[:40]!r} is not served", param="input")


def _tool_choice(choice: Any) -> Any:
    """The Responses API's named choice (``{"type": "function", "name": N}``) in chat's shape."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise RequestError(
            400,
            f"tools[{i}]: only function tools ({{'type': 'function', 'name': ...}}) are served",
            param="tools",
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _format(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if k != "type"}}
    return {"type": spec.get("type", "text")}


def to_response(
    done: Any, request: ResponseRequest, response_id: str, message_id: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Responses object for a served `Completion`, and the assistant message it adds to
    the conversation (what a follow-up's history holds)."""
    message = done.message(0)
    output = _output_items(message, message_id)
    usage = done.usage()
    incomplete = done.finish_reasons()[0] == "length"
    body = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": done.model,
        "output": output,
        "output_text": message.get("content") or "",
        "previous_response_id": request.previous_response_id,
        "instructions": request.instructions,
        "store": request.store,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "parallel_tool_calls": request.parallel_tool_calls,
        "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [],
        "text": request.text or {"format": {"type": "text"}},
        "truncation": request.truncation or "disabled",
        "error": None,
        "metadata": request.metadata or {},
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
        "kamera": done.kamera(),
    }
    return body, message


def _output_items(message: dict[str, Any], message_id: str | None) -> list[dict[str, Any]]:
    """The Responses ``output`` of an assistant message: its text as a message item, then one
    ``function_call`` item per tool call."""
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(
            {
                "type": "message",
                "id": message_id or f"msg_{uuid.uuid4().hex[:24]}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": message["content"], "annotations": []}],
            }
        )
    for call in message.get("tool_calls") or []:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex[:24]}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return output
