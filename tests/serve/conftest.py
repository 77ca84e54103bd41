"""Live ``kamera serve`` instances on loopback ports, over the shipped demo model.

Each server is the real ASGI app under a real uvicorn server in a thread of the test process
(the model loads once for the session); the tests talk to it over HTTP with the official
``openai`` client. One CLI test starts ``kamera serve`` as a process of its own.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import ctypes
import gc
import http.client
import io
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import uvicorn
from openai import OpenAI
from PIL import Image

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.config import WindowConfig
from kamera_agent.demo.model import load_demo_model
from kamera_agent.serve import KameraServer, ServeSettings
from kamera_agent.serve.app import create_app
from kamera_agent.serve.listen import uvicorn_config

MODEL = "kamera-tiny-vl"


@pytest.fixture(scope="session")
def demo_backend() -> TransformersBackend:
    model, tokenizer, image_processor = load_demo_model()
    return TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)


class LiveServer:
    """A `KameraServer` behind uvicorn on a free loopback port."""

    def __init__(self, server: KameraServer) -> None:
        self.server = server
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = uvicorn_config(
            create_app(server), server.settings, "127.0.0.1", self.port
        )  # as kamera serve
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("kamera serve did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=60, max_retries=0)

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)


@pytest.fixture
def serve(demo_backend: TransformersBackend) -> Iterator[Callable[..., LiveServer]]:
    """Start live servers: ``serve(config=WindowConfig(...), **settings)``; all stop after the test."""
    started: list[LiveServer] = []

    def start(config: WindowConfig | None = None, **settings: Any) -> LiveServer:
        live = LiveServer(
            KameraServer(
                demo_backend, ServeSettings(MODEL, config or WindowConfig(), max_tokens=4, **settings)
            )
        )
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


def frame_url(i: int, size: int = 56) -> str:
    """A distinct deterministic PNG frame as a data: URL (what an agent sends as a screenshot)."""
    image = Image.new("RGB", (size, size), (37 * i % 256, 255 - 29 * i % 256, 90 + 13 * i % 160))
    for x in range(0, size, 7):
        image.putpixel(((x + 5 * i) % size, (11 * i + x) % size), (255, 255, 255))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def shot(i: int, text: str | None = None) -> dict[str, Any]:
    """A user message holding screenshot ``i`` (and a caption)."""
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": frame_url(i)}}]
    if text:
        content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


def post(live: LiveServer, body: bytes, chunked: bool = False) -> tuple[int, Any]:
    """A raw POST to the chat route (``chunked``: with no Content-Length): (status, JSON body)."""
    connection = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    try:
        pieces = iter([body[i : i + 65536] for i in range(0, len(body), 65536)])
        connection.request(
            "POST",
            "/v1/chat/completions",
            body=pieces if chunked else body,
            headers={"Content-Type": "application/json"},
            encode_chunked=chunked,
        )
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def sent(live: LiveServer, payload: dict[str, Any], key: str | None = None) -> socket.socket:
    """A raw socket that has sent ``payload`` to the chat route (``key``: as that API key) and
    reads nothing yet: a client the test can let go of (closing it is the client going away)."""
    body = json.dumps(payload).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=60)
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def healthy(live: LiveServer) -> bool:
    """Whether ``/health`` answers 200 within a generous 10 s (a bound, not a measurement)."""
    with urllib.request.urlopen(live.url + "/health", timeout=10) as response:
        return response.status == 200


def while_healthy(live: LiveServer, attack: Callable[[], Any]) -> Any:
    """Run ``attack`` while checking ``/health`` answers meanwhile; the attack's result."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(attack)
        assert pool.submit(healthy, live).result(timeout=30)
        return running.result(timeout=600)


def error_of(call: Callable[[], Any]) -> tuple[int, dict[str, Any]]:
    """The status and error body of a call the server refuses (the call must be refused)."""
    try:
        call()
    except openai.APIStatusError as exc:
        return exc.status_code, exc.body  # type: ignore[return-value]
    raise AssertionError("the request was served")


def metric(text: str, name: str) -> str:
    """One sample of ``/metrics`` text: ``kamera_<name>``'s value."""
    line = next(line for line in text.splitlines() if line.startswith(f"kamera_{name} "))
    return line.split()[1]


def rss() -> int:
    """Resident bytes after a collection, with freed heap handed back where glibc can (what the
    process holds, not what its allocator keeps for reuse)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")
