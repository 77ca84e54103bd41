"""Live ``kamera serve`` instances on loopback ports, over the shipped demo model.

Each server is the real ASGI app under a real uvicorn server in a thread of the test process
(the model loads once for the session); the tests talk to it over HTTP with the official
``openai`` client. One CLI test starts ``kamera serve`` as a process of its own.
"""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvicorn
from openai import OpenAI
from PIL import Image

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.config import WindowConfig
from kamera_agent.demo.model import load_demo_model
from kamera_agent.serve import KameraServer, ServeSettings
from kamera_agent.serve.app import create_app

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
        config = uvicorn.Config(create_app(server), host="127.0.0.1", port=self.port, log_level="warning")
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
