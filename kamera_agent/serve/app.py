"""The HTTP face of `KameraServer`: OpenAI-compatible routes on FastAPI, streamed with SSE.

Why FastAPI + uvicorn: the de-facto ASGI stack for OpenAI-compatible servers (vLLM's and
SGLang's are built on it), with request parsing, streaming responses and a production server
we do not have to write. What faces strangers is here:

- with API keys set, every route but ``/health`` needs ``Authorization: Bearer <key>`` (401
  otherwise), and the key names the request's tenant;
- a body is read with a byte limit (413, never read whole) within ``read_timeout`` (408), and
  parsed with nesting that cannot exhaust the parser (400);
- every error is an OpenAI-style JSON body, unknown routes and unexpected faults included (a
  5xx names the error id its log line has), and every request writes one access-log line
  (`kamera_agent.serve.access`);
- ``/health`` says only that the server is alive to a caller without a key; ``/metrics``, which
  reports every tenant's traffic, is the operator's once there are several tenants;
- the model runs one forward at a time, in a worker thread; a streamed answer is handed to the
  client through a queue, and a client that goes away (mid-stream, or while waiting for a
  plain answer) stops its generation at the next decode step, freeing the model.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kamera_agent.serve.access import AccessLog
from kamera_agent.serve.feed import Cancellation, Feed
from kamera_agent.serve.listen import Concurrency, HttpMiddleware
from kamera_agent.serve.protocol import (
    ChatRequest,
    RequestError,
    internal_error,
    refuse_surrogates,
    server_error,
)
from kamera_agent.serve.response_events import response_events
from kamera_agent.serve.responses import (
    ResponseRequest,
    StoredResponse,
    to_chat,
    to_response,
)
from kamera_agent.serve.server import Completion, KameraServer

__all__ = ["Cancellation", "create_app"]


class _Tenants(HttpMiddleware):
    """Names each request's tenant by its API key (``scope["state"]["tenant"]``), refusing what
    the key may not ask (`ServeSettings.refusal`: 401, or 403 for ``/metrics``)."""

    async def http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
        refused = self.server.settings.refusal(scope["path"], header)
        if refused is not None:
            challenge = {"WWW-Authenticate": "Bearer"} if refused.status == 401 else None
            await _refused(self.server, refused, headers=challenge)(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = self.server.settings.tenant_of(header)
        await self.app(scope, receive, send)


def create_app(server: KameraServer) -> FastAPI:
    """The ASGI app: ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``."""
    app = FastAPI(title="kamera serve", version="1")

    app.add_middleware(_Tenants, server=server)
    app.add_middleware(Concurrency, server=server)  # a request past the limit costs nothing more
    app.add_middleware(AccessLog, server=server)  # outermost: every request's line; a fault's 500

    @app.exception_handler(StarletteHTTPException)
    async def http_error(raw: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code >= 500:
            return _refused(server, server_error(exc.status_code, str(exc.detail), "server_error"))
        return _refused(server, RequestError(exc.status_code, str(exc.detail)))

    _add_info_routes(app, server)
    _add_responses_routes(app, server)
    _add_stored_responses_routes(app, server)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        try:
            request = ChatRequest.model_validate(await _json(raw, server))
        except RequestError as exc:
            return _refused(server, exc)
        except ValidationError as exc:
            return _refused(server, _invalid(exc))
        tenant = raw.state.tenant
        if request.stream:
            return await _streamed(server, raw, request, tenant)
        return await _plain(server, raw, request, tenant)

    return app


def _add_info_routes(app: FastAPI, server: KameraServer) -> None:
    """``/health``, ``/v1/models`` and ``/metrics``: what the server is and how it does."""
    name = server.settings.model_name

    @app.get("/health")
    async def health(raw: Request) -> dict[str, Any]:
        """Liveness for anyone; the model and the caller's own sessions for a tenant (no count
        of another tenant's sessions: that would say how busy it is)."""
        tenant = raw.state.tenant
        if tenant is None:
            return {"status": "ok"}
        return {"status": "ok", "model": name, "sessions": server.sessions.count(tenant)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kamera-agent"}],
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")


def _add_responses_routes(app: FastAPI, server: KameraServer) -> None:
    """``POST /v1/responses``: OpenAI's Responses API over the chat path, kept when asked."""

    @app.post("/v1/responses")
    async def create_response(raw: Request) -> Response:
        try:
            request = ResponseRequest.model_validate(await _json(raw, server))
            request.refuse_unsupported()
            tenant = raw.state.tenant
            previous = (
                server.responses.get(request.previous_response_id, tenant)
                if request.previous_response_id
                else None
            )
            chat, history = to_chat(request, previous, server.settings.limits.max_messages)
        except RequestError as exc:
            return _refused(server, exc)
        except ValidationError as exc:
            return _refused(server, _invalid(exc))
        response_id = f"resp_{uuid.uuid4().hex}"

        def finish(done: Completion, body: dict[str, Any], message: dict[str, Any]) -> None:
            raw.state.served = done  # for the access log
            if request.store:
                server.responses.put(response_id, StoredResponse(tenant, [*history, message], body))

        if request.stream:
            feed = Feed(server, chat, tenant, raw.state.arrived)
            first, refusal = await _opened(server, feed)
            if refusal is not None:
                return refusal
            events = response_events(feed, first, request, response_id, finish)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            done = await _watched(server, raw, chat, tenant)
        except RequestError as exc:
            return _refused(server, exc)
        body, message = to_response(done, request, response_id)
        finish(done, body, message)
        server.metrics.request(200)
        return JSONResponse(body)


def _add_stored_responses_routes(app: FastAPI, server: KameraServer) -> None:
    """``GET`` and ``DELETE /v1/responses/{id}``: a tenant's stored responses."""

    @app.get("/v1/responses/{response_id}")
    async def get_response(raw: Request, response_id: str) -> Response:
        try:
            return JSONResponse(server.responses.get(response_id, raw.state.tenant).body)
        except RequestError as exc:
            return _refused(server, exc)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(raw: Request, response_id: str) -> Response:
        try:
            server.responses.delete(response_id, raw.state.tenant)
        except RequestError as exc:
            return _refused(server, exc)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def _json(raw: Request, server: KameraServer) -> Any:
    """The body as JSON: at most ``max_request_bytes`` read, within ``read_timeout``."""
    limit = server.settings.max_request_bytes
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the body is over the limit of {limit} bytes", code="request_too_large")

    async def read() -> bytearray:
        body = bytearray()
        async for piece in raw.stream():
            body += piece
            if len(body) > limit:
                raise RequestError(
                    413, f"the body is over the limit of {limit} bytes", code="request_too_large"
                )
        return body  # parsed as it is: a copy would double a large body's memory

    try:
        body = await asyncio.wait_for(read(), timeout=server.settings.read_timeout)
    except asyncio.TimeoutError as exc:
        raise RequestError(408, "the body did not arrive in time", code="request_timeout") from exc
    except ClientDisconnect as exc:  # nobody is left to answer; the status is for the metrics
        raise RequestError(400, "the client went away while sending", code="client_disconnected") from exc
    try:
        parsed = json.loads(body)
    except RecursionError as exc:
        raise RequestError(400, "the body is nested too deeply") from exc
    except ValueError as exc:
        raise RequestError(400, "the body is not JSON") from exc
    refuse_surrogates(body, parsed)
    return parsed


def _refused(server: KameraServer, exc: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    server.metrics.request(exc.status)
    return JSONResponse(exc.body(), status_code=exc.status, headers={**exc.headers, **(headers or {})})


async def _plain(server: KameraServer, raw: Request, request: ChatRequest, tenant: str) -> Response:
    """A whole answer; a client that disconnects while it waits stops the generation."""
    try:
        done = await _watched(server, raw, request, tenant)
    except RequestError as exc:
        return _refused(server, exc)
    server.metrics.request(200)
    raw.state.served = done  # for the access log
    return JSONResponse(_completion(done))


async def _watched(server: KameraServer, raw: Request, request: ChatRequest, tenant: str) -> Completion:
    """``server.complete`` in a worker thread, stopped at the next decode step if the client
    disconnects while it waits (the model lock is not held for nobody).

    Raises:
        RequestError: the request's refusal, or a 500 for a bug (the server goes on).
    """
    cancellation = Cancellation()
    task = asyncio.ensure_future(
        run_in_threadpool(
            server.complete,
            request,
            tenant=tenant,
            keep_going=cancellation.keep_going,
            arrived=raw.state.arrived,
        )
    )
    while not task.done():
        await asyncio.wait([task], timeout=0.25)
        if not task.done() and await raw.is_disconnected():
            cancellation.cancel()
    try:
        done = task.result()
    except RequestError:
        raise
    except Exception as exc:  # a bug: an OpenAI-style 500 for this request
        raise internal_error(exc) from exc
    if cancellation.steps_at_cancel is not None:
        server.metrics.after_cancel(cancellation.after_cancel)
    return done


def _invalid(exc: ValidationError) -> RequestError:
    """Pydantic's first complaint as a 400 naming the field."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return RequestError(400, f"{where}: {first['msg']}", param=where)


def _completion(done: Completion) -> dict[str, Any]:
    return {
        "id": done.id,
        "object": "chat.completion",
        "created": done.created,
        "model": done.model,
        "choices": [
            {
                "index": index,
                "message": done.message(index),
                "logprobs": logprobs,
                "finish_reason": finish,
            }
            for index, (answer, logprobs, finish) in enumerate(
                zip(done.answers, done.logprobs, done.finish_reasons(), strict=True)
            )
        ],
        "usage": done.usage(),
        "kamera": done.kamera(),
    }


async def _opened(server: KameraServer, feed: Feed) -> tuple[tuple[str, Any], Response | None]:
    """A stream's first event, and the plain 4xx to answer instead where the request was refused
    before its first token (the feed then stopped); a stream that opens is counted a 200."""
    first = await feed.next()
    if first[0] == "refused":
        feed.cancel()
        return first, _refused(server, first[1])
    server.metrics.request(200)
    return first, None


async def _streamed(server: KameraServer, raw: Request, request: ChatRequest, tenant: str) -> Response:
    """Runs the request in a thread, streaming its text; a request refused before its first
    token gets a plain 4xx, as a non-streamed one would. A client gone mid-stream stops it."""
    feed = Feed(server, request, tenant, raw.state.arrived)
    first, refusal = await _opened(server, feed)
    if refusal is not None:
        return refusal
    stamp = {
        "id": f"chatcmpl-{int(time.time() * 1e6):x}",
        "created": int(time.time()),
        "model": request.model,
    }
    usage = bool((request.stream_options or {}).get("include_usage"))

    async def body() -> AsyncIterator[bytes]:
        try:
            yield _event(stamp, {"role": "assistant", "content": ""})
            kind, value = first
            while True:
                if kind == "text":
                    yield _event(stamp, {"content": value})
                elif kind == "done":
                    raw.state.served = value  # for the access log
                    if value.logprobs[0] is not None:  # every token's, at the end of the text
                        yield _event(stamp, {}, logprobs=value.logprobs[0])
                    calls = value.message(0).get("tool_calls")
                    if calls:  # the calls the answer made, whole, in OpenAI's delta shape
                        yield _event(
                            stamp, {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
                        )
                    yield _event(stamp, {}, finish=value.finish_reasons()[0], kamera=value.kamera())
                    if usage:
                        yield _data(
                            {
                                **stamp,
                                "object": "chat.completion.chunk",
                                "choices": [],
                                "usage": value.usage(),
                            }
                        )
                    break
                else:  # refused after streaming began: say so in the stream and end it
                    raw.state.error_id = value.error_id
                    yield _data(value.body("server_error"))
                    break
                kind, value = await feed.next()
            yield b"data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): no decode step more for it
            feed.cancel()

    return StreamingResponse(body(), media_type="text/event-stream")


def _event(
    stamp: dict[str, Any],
    delta: dict[str, Any],
    finish: str | None = None,
    logprobs: dict[str, Any] | None = None,
    **extra: Any,
) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return _data({**stamp, "object": "chat.completion.chunk", "choices": [choice], **extra})


def _data(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
