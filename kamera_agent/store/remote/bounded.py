"""Valkey connections whose every blocking socket call ends by the calling thread's deadline.

Why in the socket: valkey-py bounds each ``recv`` by ``socket_timeout``, so a reply that
trickles in (a slow link forwarding a 16 MiB value piece by piece) takes as long as it takes,
each piece on time. A total deadline must cut the call wherever it is: here every ``recv``,
``recv_into`` and ``sendall`` of the connection waits at most until the deadline the calling
thread set (`until`), so the call fails with valkey's own ``TimeoutError`` the moment the
deadline passes, valkey drops that connection (a half-read reply is never parsed as the next
one), and the thread is free at once, never left blocked behind an abandoned call.

    with until(deadline):  client.get(name)     # every socket wait ≤ deadline − now
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["connection_class", "expired", "until"]

_LOCAL = threading.local()


@contextlib.contextmanager
def until(deadline: float | None) -> Iterator[None]:
    """Socket calls on this thread end by ``deadline`` (``time.monotonic()`` seconds; ``None``:
    only by the connection's own timeout) while the block runs."""
    outer = getattr(_LOCAL, "deadline", None)
    _LOCAL.deadline, _LOCAL.expired = deadline, False
    try:
        yield
    finally:
        _LOCAL.deadline = outer


def expired() -> bool:
    """Whether the last `until` block on this thread ran out of time inside a socket call."""
    return bool(getattr(_LOCAL, "expired", False))


class _BoundedSocket:
    """A connected socket whose blocking calls wait at most until the thread's deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def recv(self, size: int, *flags: int) -> bytes:
        return self._bounded(self._sock.recv, size, *flags)  # type: ignore[no-any-return]

    def recv_into(self, buffer: Any, *args: int) -> int:
        return self._bounded(self._sock.recv_into, buffer, *args)  # type: ignore[no-any-return]

    def sendall(self, data: Any, *flags: int) -> None:
        self._bounded(self._sock.sendall, data, *flags)

    def __getattr__(self, name: str) -> Any:  # shutdown, close, fileno, setsockopt, ...
        return getattr(self._sock, name)

    def _bounded(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` waiting at most until the thread's deadline (and the connection's timeout)."""
        deadline = getattr(_LOCAL, "deadline", None)
        if deadline is None:
            self._sock.settimeout(self._timeout)
            return call(*args)
        left = deadline - time.monotonic()
        if left <= 0:
            _LOCAL.expired = True
            raise TimeoutError("the lookup's deadline passed")
        own = math.inf if self._timeout is None else self._timeout
        self._sock.settimeout(min(own, left))
        try:
            return call(*args)
        except TimeoutError:
            _LOCAL.expired = left <= own  # the deadline's timeout, not the connection's
            raise


def connection_class(tls: bool) -> type[Any]:
    """valkey-py's connection class (TLS or plain) with bounded sockets."""
    from valkey.connection import Connection, SSLConnection

    base: type[Any] = SSLConnection if tls else Connection

    class Bounded(base):  # type: ignore[misc, valid-type]
        def _connect(self) -> Any:
            return _BoundedSocket(super()._connect())

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    return Bounded
