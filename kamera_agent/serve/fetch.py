"""``http(s)`` image URLs fetched for a stranger: public addresses only, within one deadline.

Why apart from `kamera_agent.serve.media`: fetching is the one read that crosses the network,
and both of its guards are easy to get subtly wrong:

- **where**: the name is resolved once and the connection pinned to that address (no second
  lookup to rebind), every redirect checked again, and an address is public only when every
  IPv4 address it carries is too: IPv4-mapped, 6to4 (``2002:7f00:1::`` is 127.0.0.1 to a host
  that routes 6to4), Teredo and NAT64's prefix; site-local ``fec0::/10`` and the 6to4 relay
  range ``192.88.99.0/24`` never are;
- **how long**: `ImageFetching.timeout` bounds the whole fetch (connection, every redirect,
  headers and body). A socket timeout bounds one read only, so a server sending a byte every
  few seconds held a thread for minutes; a timer cuts the connection when the time is up.

Every failure is a `FetchRefused`, whatever its cause: the client is told one text for all.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import ParseResult, urljoin, urlparse

__all__ = ["FetchRefused", "ImageFetching", "fetch", "public_address"]

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_RELAYS = ipaddress.ip_network("192.88.99.0/24")
"""6to4 relay anycast (deprecated, RFC 7526): a relay forwards into networks it chooses, and the
``is_global`` of some Python versions calls it global."""

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class FetchRefused(Exception):
    """A URL not fetched: not allowed, unreachable, not an image response, or out of time."""


@dataclass(frozen=True)
class ImageFetching:
    """Whether and how ``http(s)`` image URLs are fetched (off by default).

    Attributes:
        enabled: fetch ``http(s)`` URLs at all.
        timeout: seconds for the whole fetch: connecting, every redirect, headers and body.
        max_bytes: the most bytes an image may have.
        allow_private: also fetch from private, loopback and link-local addresses (a trusted
            network only: otherwise a client reaches the server's own services).
        max_redirects: redirects followed at most (each one checked again).
    """

    enabled: bool = False
    timeout: float = 10.0
    max_bytes: int = 20 << 20
    allow_private: bool = False
    max_redirects: int = 3


def fetch(url: str, fetching: ImageFetching) -> bytes:
    """The body ``url`` answers with, following redirects (at most ``max_bytes + 1`` bytes read:
    the caller tells a too-large image by its length).

    Raises:
        FetchRefused: for every reason it is not fetched.
    """
    deadline = _Deadline(fetching.timeout)
    for _ in range(fetching.max_redirects + 1):
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise FetchRefused("not an http(s) URL")
        try:
            connection = _connection(parsed, fetching, deadline.left())
            with deadline.watching(connection):
                location, data = _get(connection, parsed, fetching.max_bytes + 1)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise FetchRefused(type(exc).__name__) from exc
        if deadline.expired:
            raise FetchRefused("out of time")
        if location is None:
            return data
        url = urljoin(url, location)
    raise FetchRefused("too many redirects")


def public_address(address: str) -> bool:
    """Whether ``address``, and every IPv4 address it carries inside it, is a public one."""
    return all(_public(ip) for ip in _carried(ipaddress.ip_address(address.split("%", 1)[0])))


class _Deadline:
    """One fetch's time, shared by its hops; `watching` cuts a connection when it runs out."""

    def __init__(self, seconds: float) -> None:
        self.at, self.expired = time.monotonic() + seconds, False

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the fetch is out of time")
        return left

    @contextmanager
    def watching(self, connection: _Pinned) -> Iterator[None]:
        def expire() -> None:
            self.expired = True
            connection.cut()

        timer = threading.Timer(self.left(), expire)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            connection.close()


def _connection(parsed: ParseResult, fetching: ImageFetching, timeout: float) -> _Pinned:
    """A connection (not yet open) to the checked address ``parsed`` names."""
    assert parsed.hostname is not None
    https = parsed.scheme == "https"
    port = parsed.port or (443 if https else 80)
    address = _checked_address(parsed.hostname, port, fetching.allow_private)
    return (_PinnedTLS if https else _Pinned)(parsed.hostname, port, address, timeout)


def _get(connection: _Pinned, parsed: ParseResult, limit: int) -> tuple[str | None, bytes]:
    """One GET: ``(redirect location, b"")`` or ``(None, at most limit bytes of body)``."""
    path = parsed.path or "/"
    target = path + (f"?{parsed.query}" if parsed.query else "")
    connection.request("GET", target, headers={"Accept": "image/*"})
    response = connection.getresponse()
    try:
        location = response.getheader("Location")
        if response.status in _REDIRECTS and location:
            return location, b""
        if response.status != 200:
            raise ValueError(f"status {response.status}")
        return None, response.read(limit)
    finally:
        response.close()


def _checked_address(host: str, port: int, allow_private: bool) -> str:
    """The address ``host`` resolves to, if every address it resolves to may be fetched from."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = [str(info[4][0]) for info in infos]
    if not addresses or (not allow_private and not all(public_address(a) for a in addresses)):
        raise ValueError("not a public address")
    return addresses[0]


def _carried(ip: Address) -> list[Address]:
    """``ip`` and the IPv4 addresses a packet to it reaches through a translation or a tunnel:
    IPv4-mapped (``::ffff:a.b.c.d``), 6to4 (``2002:aabb:ccdd::``), Teredo (its server and its
    client) and NAT64's well-known prefix (``64:ff9b::a.b.c.d``)."""
    if isinstance(ip, ipaddress.IPv4Address):
        return [ip]
    inner: list[Address] = [ip]
    if ip.ipv4_mapped is not None:
        inner.append(ip.ipv4_mapped)
    if ip.sixtofour is not None:
        inner.append(ip.sixtofour)
    if ip.teredo is not None:
        inner.extend(ip.teredo)
    if ip in _NAT64:
        inner.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return inner


def _public(ip: Address) -> bool:
    if isinstance(ip, ipaddress.IPv4Address) and ip in _RELAYS:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:  # fec0::/10: deprecated, not global
        return False
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local)


class _Pinned(http.client.HTTPConnection):
    """An HTTP connection to one already-checked address (no second name lookup to rebind);
    `cut` shuts its socket from another thread, ending whatever read waits on it."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address
        self._raw: socket.socket | None = None

    def connect(self) -> None:
        self.sock = self._open()

    def _open(self) -> socket.socket:
        self._raw = socket.create_connection((self._address, self.port), self.timeout)
        return self._raw

    def cut(self) -> None:
        raw = self._raw
        if raw is not None:
            with contextlib.suppress(OSError):  # already closed
                raw.shutdown(socket.SHUT_RDWR)


class _PinnedTLS(_Pinned):
    """`_Pinned` over TLS, the certificate checked against the host's name."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, address, timeout)
        self._context = ssl.create_default_context()

    def connect(self) -> None:
        self.sock = self._context.wrap_socket(self._open(), server_hostname=self.host)
