"""A `KameraServer` behind a real uvicorn server on a loopback port, in a thread of this process.

Why in-process: the replay drives the server through HTTP and the official client exactly as
an agent does, while the model loads once for both sides of the comparison.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

__all__ = ["LiveServer"]


class LiveServer:
    """Serves ``server`` on 127.0.0.1 until `stop`; ``client`` is an official openai client."""

    def __init__(self, server: Any, start_timeout: float = 30.0) -> None:
        import uvicorn
        from openai import OpenAI

        from kamera_agent.serve.app import create_app

        self.server = server
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        config = uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning")
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("kamera serve did not start on a loopback port")
            time.sleep(0.01)
        self.client = OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600, max_retries=0
        )

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)
