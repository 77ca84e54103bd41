"""The access log: one structured line a request, and a JSON 500 for a fault no route caught.

Why a middleware of its own, outermost: it sees every request, refused (by the concurrency
limit, the key check, a route) or served, and the status each got. A route puts what it served
in the request's state (``served``: the `Completion`), so the line says who asked (tenant,
session), where (method, route), with what outcome (status, the error id of a 5xx), what the
prompt cost (prompt, cached and prefilled tokens) and how long it took (time to first token and
in all, from when the request arrived here, the clock the latency histograms read). A line is a
JSON object, so a log shipper reads its fields without a pattern:

    {"tenant": "a", "session": "kam-…", "method": "POST", "route": "/v1/chat/completions",
     "status": 200, "prompt_tokens": 61, "cached_tokens": 6, "prefilled_tokens": 55,
     "ttft_s": 0.041, "total_s": 0.052}

Written at ``INFO`` on ``kamera_agent.serve.access`` (``kamera serve --log-level``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import MutableMapping
from typing import Any

from starlette.responses import JSONResponse

from kamera_agent.serve.completion import Completion
from kamera_agent.serve.listen import HttpMiddleware
from kamera_agent.serve.protocol import ERROR_ID_HEADER, internal_error

__all__ = ["ACCESS_LOG", "AccessLog"]

ACCESS_LOG = logging.getLogger("kamera_agent.serve.access")


class AccessLog(HttpMiddleware):
    """Writes the access line of every HTTP request (see the module docstring); it stamps
    ``scope["state"]["arrived"]``, the time every later figure is measured from."""

    async def http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        state = scope.setdefault("state", {})
        state["arrived"] = time.perf_counter()
        sent: dict[str, Any] = {}

        async def watched(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
                names = {key.decode("latin-1").lower(): value for key, value in message.get("headers", [])}
                if ERROR_ID_HEADER in names:
                    sent["error_id"] = names[ERROR_ID_HEADER].decode("latin-1")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # before the last byte leaves: a client that has its answer finds the line written
                _write(scope, sent)
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:  # a bug no route caught: JSON, its traceback logged, the server goes on
            fault = internal_error(exc)
            state["error_id"] = fault.error_id
            if "status" not in sent:
                self.server.metrics.request(500)
                response = JSONResponse(fault.body(), status_code=500, headers=fault.headers)
                await response(scope, receive, watched)
        finally:
            _write(scope, sent)  # a response cut short (the client gone) still has its line


def _write(scope: dict[str, Any], sent: dict[str, Any]) -> None:
    """The request's access line, once."""
    if not sent.get("logged") and ACCESS_LOG.isEnabledFor(logging.INFO):
        ACCESS_LOG.info(json.dumps(access_line(scope, sent)))
    sent["logged"] = True


def access_line(scope: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any]:
    """The fields of one request's line (``sent``: the status and error id its response had)."""
    state = scope.get("state", {})
    arrived = state["arrived"]
    done: Completion | None = state.get("served")
    line: dict[str, Any] = {
        "tenant": state.get("tenant"),
        "session": done.session_id if done else None,
        "method": scope.get("method"),
        "route": scope.get("path"),
        "status": sent.get("status"),
        "prompt_tokens": done.prompt_tokens if done else None,
        "cached_tokens": done.cached_tokens if done else None,
        "prefilled_tokens": done.split.prefilled if done else None,
        "ttft_s": round(done.clock.to_first_token, 6) if done else None,
        "total_s": round(time.perf_counter() - arrived, 6),
    }
    error_id = sent.get("error_id") or state.get("error_id")
    if error_id is not None:
        line["error_id"] = error_id
    return line
