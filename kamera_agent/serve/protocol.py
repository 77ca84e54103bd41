"""The OpenAI chat-completions wire format, as much of it as ``kamera serve`` takes.

Why our own models: validation happens once, at the edge, into typed objects the rest of the
server trusts; anything a request sends that we do not serve (tool calls, audio, ``n > 1``)
is refused by name with a 400, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ChatRequest", "RequestError", "error_body"]


class RequestError(Exception):
    """A request the server refuses: the HTTP status and an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


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
    n: int = 1
    user: str | None = Field(default=None, max_length=256)
    session_id: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    kamera: dict[str, Any] | None = None
    tools: list[Any] | None = None

    @property
    def pinned(self) -> str | None:
        """The name the client gives its conversation, if any (a session within its tenant)."""
        return self.session_id or self.prompt_cache_key or self.user

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def answer_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def refuse_unsupported(self) -> None:
        """Raises `RequestError` for what we do not serve."""
        if self.n != 1:
            raise RequestError(400, "n > 1 is not served: send one request per sample", param="n")
        if self.tools:
            raise RequestError(400, "tool definitions are not served by kamera serve yet", param="tools")


Role = Literal["system", "developer", "user", "assistant", "tool"]
