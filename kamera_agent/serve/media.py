"""Image URLs from strangers: what may be read, from where, and how much.

Why strict: a server that opens any ``file://`` path or fetches any URL a client names reads the
server's own disk and network for that client (``file:///etc/passwd``, ``file:///dev/zero``, a
FIFO that never ends, ``http://127.0.0.1:6379``), and error texts that differ by cause tell the
client which paths exist. So:

- ``data:`` URLs (base64) are always read;
- ``file://`` only under an allowed folder (``--allowed-local-media-path``): a regular file,
  found after resolving links, never past the folder, at most ``max_bytes``;
- ``http(s)`` only with fetching on (`kamera_agent.serve.fetch`), never to a private, loopback,
  link-local or reserved address, nor one that carries such an IPv4 address (checked on the
  address actually connected to, after every redirect) unless ``allow_private``; at most
  ``max_bytes``, the whole fetch within ``timeout``;
- every refusal of a local or remote URL reads the same (`REFUSED`): no path, no connection
  error, no Python repr reaches the client.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from kamera_agent.moved import renamed
from kamera_agent.serve.fetch import FetchRefused, ImageFetching, fetch
from kamera_agent.serve.protocol import RequestError

__all__ = ["REFUSED", "ImageFetching", "MediaAccess", "read_url"]

REFUSED = (
    "cannot use this image URL (not allowed here, not found, not a regular file in the allowed "
    "folder, too large, or unreachable); send the image as a data: URL"
)
"""What a client is told for any local or remote URL that is not read: one text, one shape."""


@dataclass(frozen=True)
class MediaAccess:
    """Where image URLs may be read from.

    Attributes:
        fetching: ``http(s)`` fetching.
        local_folder: the folder ``file://`` URLs may name files under (``None``: none).
    """

    fetching: ImageFetching = field(default_factory=ImageFetching)
    local_folder: Path | None = None


def read_url(url: str, where: str, access: MediaAccess) -> bytes:
    """The bytes an image URL names, under ``access``.

    Raises:
        RequestError: 400, naming ``where``: a broken data URL, fetching off, or `REFUSED`.
    """
    if url.startswith("data:"):
        return _data(url, where)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return _local(parsed.path, where, access)
    if parsed.scheme in ("http", "https"):
        if not access.fetching.enabled:
            raise RequestError(
                400,
                f"{where}: fetching image URLs is off; send the image as a data: URL, or start the "
                "server with --fetch-images",
                param="messages",
            )
        return _fetched(url, where, access.fetching)
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


def _local(raw_path: str, where: str, access: MediaAccess) -> bytes:
    """A regular file under the allowed folder (links resolved first), read without blocking."""
    folder = access.local_folder
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
        limit = access.fetching.max_bytes
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


def _fetched(url: str, where: str, fetching: ImageFetching) -> bytes:
    try:
        data = fetch(url, fetching)
    except FetchRefused as exc:
        raise _refused(where) from exc
    if len(data) > fetching.max_bytes:
        raise RequestError(
            400, f"{where}: the image is larger than {fetching.max_bytes} bytes", param="messages"
        )
    return data


__getattr__ = renamed(__name__, {"MediaPolicy": "MediaAccess"})
"""A policy is a strategy registered by name; this says where images may be read: the old name
lasts a release."""
