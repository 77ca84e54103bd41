"""A slow but healthy server is not declared down: the shared tier's timeout adapts.

Why: under CPU starvation a fixed 200 ms timeout declared 6 outages and failed 69 writes while
the server was up. Here a loopback proxy in front of a live Valkey server delays every answer;
the store's timeout (0.1 s) is below the delay, so the first slow call times out. With room to
adapt (``max_timeout``) that raises the timeout and the next calls are served, no outage; with
none (``max_timeout`` equal to ``timeout``) the same delay is an outage, so the test can fail.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import ChunkStore

FP = "f" * 64


class DelayingProxy:
    """Forwards TCP between clients and ``upstream`` on loopback, holding each answer ``delay`` s."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream, self.delay = upstream, 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while self._open:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if answers and self.delay:
                    time.sleep(self.delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                end.close()

    def close(self) -> None:
        self._open = False
        self._listener.close()


@pytest.fixture
def proxy(store_url: str) -> Iterator[DelayingProxy]:
    host_port = store_url.split("//")[1].split("/")[0]
    host, port = host_port.split(":")
    proxied = DelayingProxy((host, int(port)))
    yield proxied
    proxied.close()


def _kv(key: str) -> ChunkKV:
    g = torch.Generator().manual_seed(0)
    return ChunkKV(torch.randn(2, 2, 8, 8, generator=g), torch.randn(2, 2, 8, 8, generator=g), None, key, FP)


@pytest.mark.parametrize("room", [True, False])
def test_a_slow_healthy_server_raises_the_timeout_instead_of_an_outage(
    store_url: str, proxy: DelayingProxy, room: bool
) -> None:
    writer = ChunkStore(fingerprint=FP, memory_limit=1 << 26, remote=store_url)
    for key in ("a", "b", "c"):
        writer.put_canonical(_kv(key))
    writer.flush()
    ceiling = 1.0 if room else 0.1
    url = f"redis://127.0.0.1:{proxy.port}/0?timeout=0.1&max_timeout={ceiling}"
    reader = ChunkStore(fingerprint=FP, memory_limit=1 << 26, remote=url)
    assert reader.has_canonical("a")  # the server answers quickly first
    proxy.delay = 0.15  # then slowly: longer than the timeout, well short of the ceiling
    assert reader.get_canonical("a") is None  # this call timed out: a miss, counted as an error
    time.sleep(0.3)  # past a breaker's first backoff, had one opened
    served = reader.get_canonical("b") is not None and reader.get_canonical("c") is not None
    stats = reader.stats()
    if room:
        assert served and stats.remote_outages == 0 and stats.remote_state == "up"
        assert stats.remote_slow_calls == 1 and stats.remote_timeout == pytest.approx(0.2)
    else:
        assert stats.remote_outages == 1 and stats.remote_slow_calls == 0
    reader.close()
    writer.close()
