"""A slow link on loopback: an asyncio TCP proxy that holds every forwarded chunk a while.

What a store across a congested or distant link looks like to a client: each piece of a reply
arrives late, every piece on time for a per-call timeout, so a large value takes as long as its
pieces add up to. Used by ``benchmarks/slow_store.py`` and the store's deadline tests
(``tests/store/test_deadlines.py``), in front of a real Valkey server on 127.0.0.1.

    with SlowProxy(("127.0.0.1", 6379), delay=0.3) as proxy:   # 300 ms per chunk, both ways
        url = f"redis://127.0.0.1:{proxy.port}/0"
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType

__all__ = ["SlowProxy"]

CHUNK = 1 << 16
"""The most bytes forwarded at once (one read): a 16 MiB value is 256 chunks or more."""


class SlowProxy:
    """Forwards TCP between clients on ``127.0.0.1:port`` and ``upstream``, sleeping ``delay``
    seconds before each chunk it forwards, in either direction. Its loop runs on a thread of its
    own; ``delay`` may change while it runs; `close` stops it and every connection.

    Args:
        upstream: ``(host, port)`` of the real server.
        delay: seconds added to every forwarded chunk.
    """

    def __init__(self, upstream: tuple[str, int], delay: float = 0.3) -> None:
        self.upstream, self.delay = upstream, delay
        self.chunks = 0
        """Chunks forwarded so far."""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._run, name="slow-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        assert self._server is not None, "the proxy did not start"
        self.port: int = self._server.sockets[0].getsockname()[1]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer)),
            asyncio.ensure_future(self._pump(up_reader, writer)),
        ]
        try:
            await asyncio.gather(*pumps)
        except asyncio.CancelledError:  # the proxy is closing: the connection ends here
            pass
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(CHUNK):
                await asyncio.sleep(self.delay)
                self.chunks += 1
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            sink.close()

    def close(self) -> None:
        """Stop accepting, drop every connection, stop and close the loop."""
        if self._loop.is_closed():
            return

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(RuntimeError, TimeoutError):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> SlowProxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
