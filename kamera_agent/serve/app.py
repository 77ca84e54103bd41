"""The HTTP face of `KameraServer`: OpenAI-compatible routes on FastAPI, streamed with SSE.

Why FastAPI + uvicorn: the de-facto ASGI stack for OpenAI-compatible servers (vLLM's and
SGLang's are built on it), with request parsing, streaming responses and a production server
we do not have to write. The model runs one forward at a time, in a worker thread; a streamed
answer is handed to the client through a queue, so a slow reader never holds the model up
for the others: generation runs to its end whether or not the client keeps up.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from kamera_agent.serve.protocol import ChatRequest, RequestError, error_body
from kamera_agent.serve.server import Completion, KameraServer

__all__ = ["create_app"]


def create_app(server: KameraServer) -> FastAPI:
    """The ASGI app: ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``."""
    app = FastAPI(title="kamera serve", version="1")
    name = server.settings.model_name

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": name, "sessions": len(server.sessions)}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kamera-agent"}],
        }

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        try:
            request = ChatRequest.model_validate(await _json(raw))
        except RequestError as exc:
            return _refused(server, exc)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return _refused(server, RequestError(400, f"{where}: {first['msg']}", param=where))
        if not request.stream:
            try:
                done = await run_in_threadpool(server.complete, request)
            except RequestError as exc:
                return _refused(server, exc)
            except Exception as exc:  # a bug: an OpenAI-style 500 for this request, the server goes on
                return _refused(server, RequestError(500, f"internal error: {type(exc).__name__}: {exc}"))
            server.metrics.request(200)
            return JSONResponse(_completion(done))
        return await _streamed(server, request)

    return app


async def _json(raw: Request) -> Any:
    try:
        return json.loads(await raw.body())
    except ValueError as exc:
        raise RequestError(400, f"the body is not JSON ({exc})") from exc


def _refused(server: KameraServer, exc: RequestError) -> JSONResponse:
    server.metrics.request(exc.status)
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return JSONResponse(error_body(exc.message, kind, exc.param, exc.code), status_code=exc.status)


def _completion(done: Completion) -> dict[str, Any]:
    return {
        "id": done.id,
        "object": "chat.completion",
        "created": done.created,
        "model": done.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": done.answer.text},
                "finish_reason": done.finish_reason,
            }
        ],
        "usage": done.usage(),
        "kamera": done.kamera(),
    }


async def _streamed(server: KameraServer, request: ChatRequest) -> Response:
    """Runs the request in a thread, streaming its text; a request refused before its first
    token gets a plain 4xx, as a non-streamed one would."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def put(kind: str, value: Any) -> None:
        loop.call_soon_threadsafe(events.put_nowait, (kind, value))

    def work() -> None:
        try:
            put("done", server.complete(request, on_text=lambda text: put("text", text)))
        except RequestError as exc:
            put("refused", exc)
        except Exception as exc:  # reported to this client; the server keeps serving
            put("refused", RequestError(500, f"internal error: {type(exc).__name__}: {exc}"))

    threading.Thread(target=work, name="kamera-request", daemon=True).start()
    first = await events.get()
    if first[0] == "refused":
        return _refused(server, first[1])
    server.metrics.request(200)
    stamp = {
        "id": f"chatcmpl-{int(time.time() * 1e6):x}",
        "created": int(time.time()),
        "model": request.model,
    }
    usage = bool((request.stream_options or {}).get("include_usage"))

    async def body() -> AsyncIterator[bytes]:
        yield _event(stamp, {"role": "assistant", "content": ""})
        kind, value = first
        while True:
            if kind == "text":
                yield _event(stamp, {"content": value})
            elif kind == "done":
                yield _event(stamp, {}, finish=value.finish_reason, kamera=value.kamera())
                if usage:
                    yield _data(
                        {**stamp, "object": "chat.completion.chunk", "choices": [], "usage": value.usage()}
                    )
                break
            else:  # refused after streaming began: say so in the stream and end it
                yield _data(error_body(value.message, "server_error", value.param, value.code))
                break
            kind, value = await events.get()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _event(stamp: dict[str, Any], delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return _data({**stamp, "object": "chat.completion.chunk", "choices": [choice], **extra})


def _data(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
