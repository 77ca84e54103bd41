"""Tools in a conversation: the definitions in the system block, calls as text, calls parsed back.

Why text: a conversation window holds messages as chunks, and an agent's tool history (its
calls, the tools' outputs) is messages like any other, so dropping or truncating an old tool
output is an evict, not a re-prefill. What the model reads is what its chat template renders:

- the tool definitions belong to the system block (the template renders them there), so they
  are part of the conversation's anchor: `system_with_tools` asks the template for the system
  block with the tools and returns its content, which then frames the conversation as a system
  prompt does (a template that ignores ``tools`` is refused by name, never silently);
- an assistant message's calls are rendered in the template family's call format, chosen from
  the template (`tool_format_for`): `HERMES` (``<tool_call>\\n{"name": …, "arguments": {…}}\\n
  </tool_call>``, what ChatML and Qwen templates use) or `LLAMA3_JSON` (Llama 3.1-3.3's bare
  ``{"name": …, "parameters": {…}}``, tool results in the ``ipython`` role); `TOOL_FORMATS`
  is the registry; a tool message is a message of role ``tool``;
- the answer is parsed back in the same format (`ToolFormat.parse`): calls become
  ``message.tool_calls``; a streamed answer holds back text from the first call marker on
  (`CallFilter`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kamera_agent.chunks.chat import ChatTemplate
from kamera_agent.serve.protocol import RequestError

__all__ = [
    "HERMES",
    "LLAMA3_JSON",
    "TOOL_FORMATS",
    "CallFilter",
    "ToolFormat",
    "system_with_tools",
    "tool_format_for",
]

_A = "\u2063KAMERA_TOOLS_A\u2063"


@dataclass(frozen=True)
class ToolFormat:
    """How a template family writes a tool call in text, and reads it back.

    Attributes:
        open: the text before a call's JSON (``<tool_call>\\n``; ``""``: a bare JSON call, which
            is then the whole answer).
        close: the text after it (``\\n</tool_call>``).
        separator: between two calls, and between an assistant's text and its first call.
        arguments_key: the key of a call's arguments in its JSON (``arguments``; Llama 3's
            ``parameters``).
        prefix: text a model may put before a bare call (Llama's ``<|python_tag|>``), dropped.
    """

    name: str
    open: str
    close: str
    separator: str
    arguments_key: str = "arguments"
    prefix: str = ""

    def render(self, content: str | None, calls: Sequence[dict[str, Any]], where: str = "messages") -> str:
        """An assistant message's text: its content, then each call as the template writes it.

        Raises:
            RequestError: a call's ``arguments`` that are not JSON, or nested past what the
                parser takes (named ``<where>.tool_calls[i].function.arguments``).
        """
        pieces = [content] if content else []
        for i, call in enumerate(calls):
            function = call.get("function", call)
            if not isinstance(function, dict):
                raise RequestError(400, f"{where}.tool_calls[{i}].function: an object", param="messages")
            arguments = function.get("arguments", {})
            here = f"{where}.tool_calls[{i}].function.arguments"
            if isinstance(arguments, str):  # OpenAI sends a JSON string; templates render an object
                arguments = _arguments(arguments, here)
            body = '{"name": "' + str(function.get("name", "")) + f'", "{self.arguments_key}": '
            try:
                written = json.dumps(arguments, ensure_ascii=False)
            except (RecursionError, ValueError, TypeError) as exc:
                raise RequestError(400, f"{here}: not JSON the server can write", param="messages") from exc
            pieces.append(self.open + body + written + "}" + self.close)
        return self.separator.join(pieces)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of an answer: each well-formed call (JSON with a ``name``) in
        OpenAI's shape with a fresh id; text around them is the content (``None`` if empty).
        A call that does not parse stays in the content, as the model wrote it."""
        if not self.marker:
            return self._parse_bare(text)
        calls: list[dict[str, Any]] = []
        content_parts: list[str] = []
        rest = text
        while (start := rest.find(self.open.strip())) >= 0:
            end = rest.find(self.close.strip(), start)
            if end < 0:
                break
            raw = rest[start + len(self.open.strip()) : end].strip()
            call = _call(raw)
            if call is None:
                content_parts.append(rest[: end + len(self.close.strip())])
            else:
                content_parts.append(rest[:start])
                calls.append(call)
            rest = rest[end + len(self.close.strip()) :]
        content_parts.append(rest)
        content = "".join(content_parts).strip()
        return (content or None), calls

    @property
    def marker(self) -> str:
        """The text a call starts with (what a stream holds back; ``""``: a bare call)."""
        return self.open.strip()

    def _parse_bare(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A bare-JSON answer: calls when the whole answer is calls, else text."""
        said = text.strip().removeprefix(self.prefix).strip() if self.prefix else text.strip()
        pieces = [piece.strip() for piece in (said.split(self.separator) if self.separator else [said])]
        calls = [_call(piece) for piece in pieces]
        if said and all(call is not None for call in calls):
            return None, [call for call in calls if call is not None]
        return text.strip() or None, []


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n")
"""Hermes-style calls, as ChatML and Qwen2/2.5 templates (and the demo model's) render them."""

LLAMA3_JSON = ToolFormat("llama3_json", "", "", "; ", arguments_key="parameters", prefix="<|python_tag|>")
"""Llama 3.1-3.3's JSON tool calls: the whole answer is ``{"name": …, "parameters": {…}}``."""

TOOL_FORMATS: dict[str, ToolFormat] = {each.name: each for each in (HERMES, LLAMA3_JSON)}
"""The call formats served, by name (a template family's format is added here)."""


def tool_format_for(tokenizer: Any) -> ToolFormat:
    """The call format of the tokenizer's chat template: Hermes where it writes ``<tool_call>``
    (and by default), Llama 3's JSON where it has the ``ipython`` role or ``<|python_tag|>``."""
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if "<tool_call>" in template:
        return HERMES
    if "ipython" in template or "<|python_tag|>" in template:
        return LLAMA3_JSON
    return HERMES


def _arguments(text: str, where: str) -> Any:
    """A call's ``arguments`` string as the object the template renders."""
    try:
        return json.loads(text) if text.strip() else {}
    except RecursionError as exc:
        raise RequestError(400, f"{where}: nested too deeply", param="messages") from exc
    except ValueError as exc:
        raise RequestError(400, f"{where}: not JSON: {text[:60]!r}", param="messages") from exc


def _call(raw: str) -> dict[str, Any] | None:
    try:
        payload = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": payload["name"],
            "arguments": arguments
            if isinstance(arguments, str)
            else json.dumps(arguments, ensure_ascii=False),
        },
    }


def system_with_tools(
    tokenizer: Any, template: ChatTemplate, system: str | None, tools: list[dict[str, Any]]
) -> str:
    """The system block's content with ``tools`` rendered in it by the model's own template.

    Raises:
        RequestError: the template does not render tools (they would be silently dropped), or
            renders them somewhere other than the system block.
    """
    if system is not None:
        rendered = _render(tokenizer, [{"role": "system", "content": system}], tools)
    else:
        opened = template.opens["user"] + _A
        rendered = _render(tokenizer, [{"role": "user", "content": _A}], tools).partition(opened)[0]
    plain = template.anchor(system)
    if not rendered.startswith(template.system_open) or not rendered.endswith(template.system_close):
        raise RequestError(
            400, "the model's chat template renders tools outside its system block", param="tools"
        )
    if rendered == plain:
        raise RequestError(
            400, "the model's chat template does not render tools: they would be dropped", param="tools"
        )
    return rendered[len(template.system_open) : len(rendered) - len(template.system_close)]


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    try:  # Llama 3.1's template would put tools in the first user message; ask for the system block
        text: str = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=False, tokenize=False, tools_in_user_message=False
        )
    except Exception as exc:  # a template may raise on tools it does not support
        raise RequestError(
            400, f"the model's chat template cannot render these tools: {exc}"[:300], param="tools"
        ) from exc
    return text


class CallFilter:
    """Passes a streamed answer's text on until a tool call may begin: text that could be the
    start of the call marker is held back, and everything from the marker on is kept for the
    parse at the end (a client sees calls as ``tool_calls``, never as text)."""

    def __init__(self, on_text: Callable[[str], None], tool_format: ToolFormat) -> None:
        self.on_text, self.marker = on_text, tool_format.marker
        self.starts = ("{", tool_format.prefix) if tool_format.prefix else ("{",)  # a bare call's
        self.text, self.sent, self.calling, self.plain = "", 0, False, False

    def __call__(self, piece: str) -> None:
        self.text += piece
        if self.calling:
            return
        if self.plain:
            self._send(len(self.text))
            return
        if not self.marker:  # a bare call is the whole answer: decided by how the answer starts
            begun = self.text.lstrip()
            if not begun or any(start.startswith(begun) for start in self.starts if len(begun) < len(start)):
                return  # too little to tell yet
            self.calling = begun.startswith(self.starts)
            self.plain = not self.calling
            self._send(0 if self.calling else len(self.text))
            return
        found = self.text.find(self.marker)
        if found >= 0:
            self.calling = True
            self._send(found)
            return
        safe = len(self.text)
        for n in range(min(len(self.marker) - 1, safe), 0, -1):
            if self.text.endswith(self.marker[:n]):
                safe -= n
                break
        self._send(safe)

    def _send(self, upto: int) -> None:
        if upto > self.sent:
            self.on_text(self.text[self.sent : upto])
            self.sent = upto

    def flush(self, content: str | None) -> None:
        """At the end: without a call, the text held back; with calls, the content the parse kept
        after them (the text before the first call was sent already)."""
        if not self.calling:
            self._send(len(self.text))
            return
        before = self.text[: self.sent].strip()
        if content and content.startswith(before) and len(content) > len(before):
            self.on_text(content[len(before) :])
