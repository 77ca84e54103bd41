"""The OpenAI chat-completions wire format, as much of it as ``kamera serve`` takes.

Why our own models: validation happens once, at the edge, into typed objects the rest of the
server trusts; anything a request sends that we do not serve (tools, structured output, audio,
any field we do not know) is refused by name with a 400, never silently dropped. The few fields
accepted and not acted on are listed in `IGNORED`, each with the reason it changes nothing.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kamera_agent.backends.decode_config import Constraint, DecodeConfig
from kamera_agent.errors import SettingsError

__all__ = [
    "ERROR_ID_HEADER",
    "IGNORED",
    "MAX_CHOICES",
    "ChatRequest",
    "RequestError",
    "error_body",
    "internal_error",
    "refuse_surrogates",
    "server_error",
]

MAX_CHOICES = 8
"""The most choices one request may ask for (``n``): each is a decode in the request's turns."""

IGNORED: dict[str, str] = {
    "metadata": "tags for OpenAI's stored completions; nothing is stored, the answer is the same",
    "service_tier": "one tier here; accepted when 'auto' or 'default'",
    "modalities": "text is the only output; accepted when ['text']",
    "store": "completions are never stored here; accepted when false",
}
"""Fields accepted and not acted on, with why that changes nothing (docs/serve.md lists them)."""


ERROR_ID_HEADER = "x-kamera-error-id"
"""The response header a 5xx names its error id in (the body's ``error.error_id``, the log's)."""

_LOG = logging.getLogger("kamera_agent.serve")
_TOKEN_ID = re.compile("[0-9]{1,10}")
"""A ``logit_bias`` key: ASCII digits only (``"²"`` passes ``str.isdigit`` and fails ``int``)."""
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")
"""Where JSON can carry a surrogate: an escape, or UTF-8 bytes of one (``json`` lets both through;
a pair of escapes is one character once parsed, and legal)."""


class RequestError(Exception):
    """A request the server refuses: the HTTP status and an OpenAI-style error body (a 5xx's
    carries the ``error_id`` its log line has: `internal_error`, `server_error`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_id = error_id

    def body(self, kind: str | None = None) -> dict[str, Any]:
        """The error as OpenAI's body (``kind``: its ``type``, by default from the status)."""
        kind = kind or ("invalid_request_error" if self.status < 500 else "server_error")
        return error_body(self.message, kind, self.param, self.code, self.error_id)

    @property
    def headers(self) -> dict[str, str]:
        """Response headers the refusal brings: when to retry (429), the error id (5xx)."""
        headers = {"Retry-After": "1"} if self.status == 429 else {}
        if self.error_id is not None:
            headers[ERROR_ID_HEADER] = self.error_id
        return headers


def internal_error(exc: BaseException) -> RequestError:
    """A bug's 500, its traceback logged under an error id the response carries: the client is
    told the exception's type and the id, the operator the whole of it (an unlogged 500 leaves
    nothing to mend, and one the client cannot name cannot be found in the log)."""
    error_id = _error_id()
    _LOG.error("%s: internal error while serving a request", error_id, exc_info=exc)
    message = f"internal error ({type(exc).__name__}); error id {error_id}"
    return RequestError(500, message, code="internal_error", error_id=error_id)


def server_error(status: int, message: str, code: str) -> RequestError:
    """A 5xx that is no fault (the server busy): logged under an error id, as a fault's is."""
    error_id = _error_id()
    _LOG.warning("%s: %d %s", error_id, status, message)
    return RequestError(status, f"{message}; error id {error_id}", code=code, error_id=error_id)


def _error_id() -> str:
    return f"err-{secrets.token_hex(8)}"


def refuse_surrogates(raw: bytes | bytearray, body: Any) -> None:
    """Refuse a body whose text holds a lone surrogate (``"\\ud800"``): it is not Unicode, and
    the tokenizer, hashing and the chat template each fail on it differently.

    Args:
        raw: the body as sent (the walk runs only where it could hold one).
        body: the body parsed.

    Raises:
        RequestError: 400 naming the field.
    """
    if not _MAYBE_SURROGATE.search(raw):
        return
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
            texts = list(value)
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
            texts = []
        else:
            texts = [value] if isinstance(value, str) else []
        if any(_LONE_SURROGATE.search(text) for text in texts):
            field = re.split(r"[.\[]", path, maxsplit=1)[0] or None
            raise RequestError(
                400, f"{path or 'a key'}: the text holds a lone surrogate; send valid Unicode", param=field
            )


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None, error_id: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object (and a 5xx's ``error_id``, the key to its log line)."""
    body: dict[str, Any] = {"message": message, "type": kind, "param": param, "code": code}
    if error_id is not None:
        body["error_id"] = error_id
    return {"error": body}


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions``: the fields we serve (others are refused or ignored, below).

    kamera's own fields ride in the body (the official client's ``extra_body``): ``session_id``
    (or OpenAI's ``prompt_cache_key``, or ``user``) pins a conversation to a window within the
    caller's tenant; ``kamera`` holds fidelity overrides for a new session (``{"rank": "full"}``)
    or ``{"preset": "exact"}``.
    """

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    user: str | None = Field(default=None, max_length=256)
    session_id: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    kamera: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    response_format: dict[str, Any] | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True

    @property
    def pinned(self) -> str | None:
        """The name the client gives its conversation, if any (a session within its tenant)."""
        return self.session_id or self.prompt_cache_key or self.user

    @property
    def answer_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def decode_config(self, max_tokens: int, constraint: Callable[[], Constraint] | None) -> DecodeConfig:
        """The request's decode settings, built (and so checked) once; each choice's are derived
        from them (`DecodeConfig.for_choice`). ``max_tokens``: the server's default answer length.

        Raises:
            RequestError: a setting `DecodeConfig` refuses (400, the field named).
        """
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return DecodeConfig(
                max_new_tokens=self.answer_tokens or max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                seed=self.seed,
                stop=stops,
                logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                top_logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                constraint=constraint,
            )
        except SettingsError as exc:
            named = str(exc).split(" ", 1)[0]
            param = named if named in type(self).model_fields else None
            raise RequestError(400, str(exc), param=param) from exc

    def refuse_unsupported(self) -> None:
        """Raises `RequestError` naming the first field we do not serve."""
        for name in sorted(self.model_extra or {}):
            if name not in IGNORED:
                raise RequestError(
                    400,
                    f"{name!r} is not a field kamera serve takes; remove it (docs/serve.md lists "
                    "what is served)",
                    param=name,
                )
        self._refuse_ignored_values()
        self._check_tools()
        kind = (self.response_format or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise RequestError(
                400,
                f"response_format {str(kind)[:40]!r} is not served: 'text', 'json_object' or 'json_schema'",
                param="response_format",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if not _TOKEN_ID.fullmatch(token) or not -100 <= bias <= 100:
                    raise RequestError(
                        400,
                        f"logit_bias maps token ids to numbers in [-100, 100]; got {token[:20]!r}: {bias}",
                        param="logit_bias",
                    )
        if self.stream and self.n > 1:
            raise RequestError(400, "n > 1 is served without stream only", param="n")
        self._check_continuation()

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is parsed for tool calls (tools given, ``tool_choice`` not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The functions the answer must call (``tool_choice`` ``required``: any of the tools;
        a named function: that one), or ``None`` when the model may answer in text."""
        if self.tool_choice == "required":
            return [tool["function"] for tool in self.tools or []]
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            return [tool["function"] for tool in self.tools or [] if tool["function"]["name"] == name]
        return None

    def _check_tools(self) -> None:
        for i, tool in enumerate(self.tools or []):
            function = tool.get("function") if tool.get("type") == "function" else None
            if (
                not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not function["name"]
            ):
                raise RequestError(
                    400,
                    f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                    param="tools",
                )
        choice = self.tool_choice
        if isinstance(choice, dict):
            function = choice.get("function") if choice.get("type") == "function" else None
            name = function.get("name") if isinstance(function, dict) else None
            names = [tool["function"]["name"] for tool in self.tools or []]
            if name not in names:
                raise RequestError(
                    400,
                    "a named tool_choice is {'type': 'function', 'function': {'name': N}} with N one of "
                    f"the request's tools ({', '.join(names)[:120] or 'none given'})",
                    param="tool_choice",
                )
        elif choice not in (None, "auto", "none", "required"):
            raise RequestError(
                400,
                f"tool_choice {str(choice)[:60]!r}: 'auto', 'none', 'required' or a named function",
                param="tool_choice",
            )
        if choice in ("auto", "required") and not self.tools:
            raise RequestError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        formatted = (self.response_format or {}).get("type", "text") != "text"
        if self.forced_tools is not None and formatted:
            raise RequestError(
                400,
                "response_format and a required tool call both constrain the answer; send one of them",
                param="tool_choice",
            )

    def _check_continuation(self) -> None:
        """vLLM's ``continue_final_message``: the answer continues the final assistant message,
        which takes ``add_generation_prompt: false`` (no new assistant message opened)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError(
                400,
                "continue_final_message continues the last assistant message instead of opening a new "
                "one: send add_generation_prompt: false with it",
                param="add_generation_prompt",
            )
        if not self.continue_final_message and not self.add_generation_prompt:
            raise RequestError(
                400,
                "add_generation_prompt: false is served with continue_final_message: true only (an "
                "answer otherwise opens an assistant message)",
                param="add_generation_prompt",
            )
        if self.continue_final_message and (self.calls_tools or self.response_format is not None):
            raise RequestError(
                400,
                "continue_final_message is not served with tools or response_format (their parsers "
                "and grammars read a whole answer); send it without them",
                param="continue_final_message",
            )

    def _refuse_ignored_values(self) -> None:
        extra = self.model_extra or {}
        allowed = {
            "service_tier": (None, "auto", "default"),
            "modalities": (None, ["text"]),
            "store": (None, False),
        }
        for name, values in allowed.items():
            if name in extra and extra[name] not in values:
                raise RequestError(400, f"{name}={extra[name]!r} is not served: {IGNORED[name]}", param=name)


Role = Literal["system", "developer", "user", "assistant", "tool"]
