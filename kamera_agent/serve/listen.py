"""The listening side of ``kamera serve``: uvicorn, with deadlines and a limit for slow peers.

Why not uvicorn as it comes: it never times out a request's headers (its keep-alive timer runs
only between requests), so sockets that drip their headers a byte at a time hold the process's
file descriptors until none is left and ``/health`` stops answering. Here:

- **header deadline**: a connection has ``header_timeout`` seconds to send each request's
  headers (from when it opens, or when its last response ended); late, it gets 408 and is
  closed, its descriptor freed. This is uvicorn's own h11 protocol with one timer added
  (`guarded_protocol`), since nothing above the protocol sees a request before its headers;
- **body deadline**: the body must then arrive within ``read_timeout`` (408; the app's reader);
- **concurrency limit**: at most ``max_concurrent`` requests in the server at once, every
  tenant's together (503 with ``Retry-After`` past it, an OpenAI-style body); ``/health`` is
  never refused, so a probe still sees a server that is busy rather than dead.

What a reverse proxy should still add in front (docs/serve.md): TLS, a per-address connection
limit and rate limit, and its own header and body deadlines at the edge of the network.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kamera_agent.serve.protocol import server_error
from kamera_agent.serve.server import KameraServer
from kamera_agent.serve.settings import ServeSettings

__all__ = ["Concurrency", "HttpMiddleware", "guarded_protocol", "uvicorn_config"]

_LATE = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_UNLIMITED = frozenset({"/health"})


def uvicorn_config(
    app: Any, settings: ServeSettings, host: str, port: int, log_level: str = "warning"
) -> uvicorn.Config:
    """uvicorn's settings for ``app`` under ``settings``' deadlines (the h11 protocol, guarded);
    its own access log off (the app writes one line a request with what uvicorn cannot know:
    `kamera_agent.serve.access`)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        http=guarded_protocol(settings.header_timeout),
    )


def guarded_protocol(header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers take longer than
    ``header_timeout`` seconds (with a 408)."""
    return type("GuardedH11Protocol", (_Guarded,), {"header_timeout": header_timeout})


class _Guarded(H11Protocol):
    header_timeout = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a request's headers are in
            self._stop_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_headers()  # the next request's headers, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop_timer()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(_LATE)
            self.transport.close()

    def _stop_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None


class HttpMiddleware:
    """A plain ASGI middleware of ``server`` (no response wrapped in a class of its own, so
    streaming and disconnects pass through): it acts on HTTP requests (`http`) and passes
    anything else (lifespan events) through untouched."""

    def __init__(self, app: Any, server: KameraServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise NotImplementedError


class Concurrency(HttpMiddleware):
    """An ASGI middleware admitting at most ``max_concurrent`` requests at once (``/health``
    always): each may hold a worker thread, a place in the model's queue and its body's memory."""

    def __init__(self, app: Any, server: KameraServer) -> None:
        super().__init__(app, server)
        self.active = 0

    async def http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] in _UNLIMITED:
            await self.app(scope, receive, send)
            return
        limit = self.server.settings.max_concurrent
        if self.active >= limit:
            self.server.metrics.request(503)
            await _busy(send, limit)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


async def _busy(send: Any, limit: int) -> None:
    busy = server_error(
        503, f"the server has {limit} requests in progress, its limit; retry shortly", "server_busy"
    )
    payload = json.dumps(busy.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"retry-after", b"1"),
        *((name.encode(), value.encode()) for name, value in busy.headers.items()),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
