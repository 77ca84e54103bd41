"""A slow peer, run as a process of its own (its own file descriptors): ``sockets`` connections
that each send the start of a request and then one header byte every 0.3 s, never finishing,
and one ``/health`` request sent among them. Prints what it saw as JSON: how many connections
it opened, how many the server closed, and the health check's status.

Usage: ``python tests/serve/slow_peer.py PORT SOCKETS SECONDS``
"""

from __future__ import annotations

import json
import resource
import socket
import sys
import threading
import time
import urllib.request
from typing import Any


def _probe(port: int, out: dict[str, Any]) -> None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=20) as response:
            out["status"] = response.status
    except Exception as exc:  # reported, not raised: the parent asserts on it
        out["status"] = repr(exc)


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server ended this connection (EOF, a reset, or its 408); otherwise one more
    header byte is sent."""
    try:
        sock.recv(4096)
        return True  # b"" (EOF), or the 408 the server sends as it closes
    except BlockingIOError:
        pass
    except OSError:
        return True
    try:
        sock.send(b"X")
    except OSError:
        return True
    return False


def main() -> None:
    port, count, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    sockets, began = [], time.monotonic()
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        sock.setblocking(False)  # a read or a send never waits: the server's doing is what is watched
        sockets.append(sock)
    health: dict[str, Any] = {}
    threading.Thread(target=_probe, args=(port, health), daemon=True).start()
    still, end = list(sockets), time.monotonic() + seconds
    while still and time.monotonic() < end:
        still = [sock for sock in still if not _closed_by_server(sock)]
        time.sleep(0.3)
    while "status" not in health and time.monotonic() < end + 20:
        time.sleep(0.1)
    report = {"opened": len(sockets), "closed": count - len(still), "health": health.get("status")}
    print(json.dumps({**report, "seconds": round(time.monotonic() - began, 1)}))


if __name__ == "__main__":
    main()
