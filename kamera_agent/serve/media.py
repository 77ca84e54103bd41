"""Image URLs from strangers: what may be read, from where, and how much.

Why strict: a server that opens any ``file://`` path or fetches any URL a client names reads the
server's own disk and network for that client (``file:///etc/passwd``, ``file:///dev/zero``, a
FIFO that never ends, ``http://127.0.0.1:6379``), and error texts that differ by cause tell the
client which paths exist. So:

- ``data:`` URLs (base64) are always read;
- ``file://`` only under an allowed folder (``--allowed-local-media-path``): a regular file,
  found after resolving links, never past the folder, at most ``max_bytes``;
- ``http(s)`` only with fetching on, never to a private, loopback, link-local or reserved
  address (checked on the address actually connected to, after every redirect) unless
  ``allow_private``; at most ``max_bytes``, within ``timeout``;
- every refusal of a local or remote URL reads the same (`REFUSED`): no path, no connection
  error, no Python repr reaches the client.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import os
import socket
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import ParseResult, unquote, urljoin, urlparse

from kamera_agent.serve.protocol import RequestError

__all__ = ["REFUSED", "ImageFetching", "MediaPolicy", "read_url"]

REFUSED = (
    "cannot use this image URL (not allowed here, not found, not a regular file in the allowed "
    "folder, too large, or unreachable); send the image as a data: URL"
)
"""What a client is told for any local or remote URL that is not read: one text, one shape."""
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True)
class ImageFetching:
    """Whether and how ``http(s)`` image URLs are fetched (off by default).

    Attributes:
        enabled: fetch ``http(s)`` URLs at all.
        timeout: seconds for each connection and read.
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


@dataclass(frozen=True)
class MediaPolicy:
    """Where image URLs may be read from.

    Attributes:
        fetching: ``http(s)`` fetching.
        local_folder: the folder ``file://`` URLs may name files under (``None``: none).
    """

    fetching: ImageFetching = ImageFetching()
    local_folder: Path | None = None


def read_url(url: str, where: str, policy: MediaPolicy) -> bytes:
    """The bytes an image URL names, under ``policy``.

    Raises:
        RequestError: 400, naming ``where``: a broken data URL, fetching off, or `REFUSED`.
    """
    if url.startswith("data:"):
        return _data(url, where)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return _local(parsed.path, where, policy)
    if parsed.scheme in ("http", "https"):
        if not policy.fetching.enabled:
            raise RequestError(
                400,
                f"{where}: fetching image URLs is off; send the image as a data: URL, or start the "
                "server with --fetch-images",
                param="messages",
            )
        return _fetch(url, where, policy.fetching)
    raise RequestError(400, f"{where}: image_url must be a data:, file:// or http(s) URL", param="messages")


def _refused(where: str) -> RequestError:
    return RequestError(400, f"{where}: {REFUSED}", param="messages", code="image_url_refused")


def _data(url: str, where: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or ";base64" not in header:
        raise RequestError(400, f"{where}: a data URL must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(400, f"{where}: broken base64 in the data URL", param="messages") from exc


def _local(raw_path: str, where: str, policy: MediaPolicy) -> bytes:
    """A regular file under the allowed folder (links resolved first), read without blocking."""
    folder = policy.local_folder
    if folder is None:
        raise _refused(where)
    try:
        root = os.path.realpath(folder)
        real = os.path.realpath(unquote(raw_path))
        if os.path.commonpath([root, real]) != root or real == root:
            raise _refused(where)
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (OSError, ValueError) as exc:
        raise _refused(where) from exc
    try:
        info = os.fstat(fd)
        limit = policy.fetching.max_bytes
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise _refused(where)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise _refused(where) from exc
    finally:
        os.close(fd)
    if len(data) > limit:
        raise _refused(where)
    return data


def _fetch(url: str, where: str, fetching: ImageFetching) -> bytes:
    """GET ``url``, following redirects, each hop's address checked where it is connected to."""
    for _ in range(fetching.max_redirects + 1):
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise _refused(where)
        try:
            response, connection = _get(parsed, fetching)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise _refused(where) from exc
        try:
            if response.status in _REDIRECTS and response.getheader("Location"):
                url = urljoin(url, response.getheader("Location") or "")
                continue
            if response.status != 200:
                raise _refused(where)
            data: bytes = response.read(fetching.max_bytes + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise _refused(where) from exc
        finally:
            response.close()
            connection.close()
        if len(data) > fetching.max_bytes:
            raise RequestError(
                400, f"{where}: the image is larger than {fetching.max_bytes} bytes", param="messages"
            )
        return data
    raise _refused(where)


def _get(
    parsed: ParseResult, fetching: ImageFetching
) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
    """One GET over a connection to a checked address (the name resolved once, here)."""
    assert parsed.hostname is not None
    https = parsed.scheme == "https"
    port = parsed.port or (443 if https else 80)
    address = _checked_address(parsed.hostname, port, fetching.allow_private)
    connection: http.client.HTTPConnection
    if https:
        connection = _PinnedHTTPS(parsed.hostname, port, address, fetching.timeout)
    else:
        connection = _PinnedHTTP(parsed.hostname, port, address, fetching.timeout)
    path = parsed.path or "/"
    target = path + (f"?{parsed.query}" if parsed.query else "")
    try:
        connection.request("GET", target, headers={"Accept": "image/*"})
        return connection.getresponse(), connection
    except BaseException:
        connection.close()
        raise


def _checked_address(host: str, port: int, allow_private: bool) -> str:
    """The address ``host`` resolves to, if every address it resolves to may be fetched from."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = [info[4][0] for info in infos]
    if not addresses or (not allow_private and not all(_public(str(a)) for a in addresses)):
        raise ValueError("not a public address")
    return str(addresses[0])


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local)


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to one already-checked address (no second name lookup to rebind)."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """`_PinnedHTTP` over TLS, the certificate checked against the host's name."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]
