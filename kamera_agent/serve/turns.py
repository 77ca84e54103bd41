"""Chat messages into turns of text and images, every image read and checked at the edge.

Why decode here: an image is recognised by its pixels (the chunk's content key hashes the
preprocessed pixels), so the same screenshot re-sent as base64, as a file, or from a URL is
the same chunk. Decoding fails here, with a 400 naming the message and part, before any
window is touched.

Images: ``data:`` URLs (base64 PNG, JPEG, WebP, GIF) and ``file://`` paths always; ``http(s)``
only when the server was started with fetching on, with a timeout and a size limit.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

from kamera_agent.chunks.sources import MAX_IMAGE_PIXELS
from kamera_agent.serve.protocol import RequestError

__all__ = ["ImageFetching", "ImageReader", "Turn", "read_turns"]


@dataclass(frozen=True)
class Turn:
    """One message: its role and parts (``str`` text, or a decoded ``PIL.Image``), plus a digest
    of its content for matching requests to sessions."""

    role: str
    parts: tuple[Any, ...]
    digest: str


@dataclass(frozen=True)
class ImageFetching:
    """Whether and how ``http(s)`` image URLs are fetched (off by default)."""

    enabled: bool = False
    timeout: float = 10.0
    max_bytes: int = 20 << 20


class ImageReader:
    """Reads image parts, keeping the last decoded images by content (a conversation re-sends
    the same base64 every turn; decoding it again would be wasted)."""

    def __init__(
        self, fetching: ImageFetching, cache_size: int = 256, max_pixels: int = MAX_IMAGE_PIXELS
    ) -> None:
        self.fetching = fetching
        self.max_pixels = max_pixels
        self._cache: OrderedDict[str, Image.Image] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # requests are read concurrently, outside the model lock

    def read(self, url: str, where: str) -> tuple[Image.Image, str]:
        """``(image, sha256 of its bytes)``; `RequestError` (400) for anything unreadable."""
        data = self._bytes(url, where)
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            cached = self._cache.get(digest)
            if cached is not None:
                self._cache.move_to_end(digest)
                return cached, digest
        try:
            opened = Image.open(io.BytesIO(data))
            width, height = opened.size  # from the header: checked before the pixels are decoded
            if width * height > self.max_pixels or width <= 0 or height <= 0:
                raise RequestError(
                    400,
                    f"{where}: a {width}x{height} image is outside 1..{self.max_pixels:,} pixels; resize it",
                )
            opened.load()
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise RequestError(400, f"{where}: the image does not decode ({exc})", param="messages") from exc
        image = opened.convert("RGB")
        with self._lock:
            self._cache[digest] = image
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return image, digest

    def _bytes(self, url: str, where: str) -> bytes:
        if url.startswith("data:"):
            header, comma, payload = url.partition(",")
            if not comma or ";base64" not in header:
                raise RequestError(400, f"{where}: a data URL must be base64 (data:image/png;base64,...)")
            try:
                return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise RequestError(
                    400, f"{where}: broken base64 in the data URL ({exc})", param="messages"
                ) from exc
        parsed = urlparse(url)
        if parsed.scheme == "file":
            path = Path(unquote(parsed.path))
            try:
                return path.read_bytes()
            except OSError as exc:
                raise RequestError(
                    400, f"{where}: cannot read {path} ({exc.strerror})", param="messages"
                ) from exc
        if parsed.scheme in ("http", "https"):
            if not self.fetching.enabled:
                raise RequestError(
                    400,
                    f"{where}: fetching image URLs is off; send the image as a data: URL, or start the "
                    "server with --fetch-images",
                    param="messages",
                )
            return self._fetch(url, where)
        raise RequestError(
            400, f"{where}: image_url must be a data:, file:// or http(s) URL", param="messages"
        )

    def _fetch(self, url: str, where: str) -> bytes:
        limit = self.fetching.max_bytes
        try:
            with urllib.request.urlopen(url, timeout=self.fetching.timeout) as response:
                data: bytes = response.read(limit + 1)
        except OSError as exc:
            raise RequestError(400, f"{where}: fetching {url} failed ({exc})", param="messages") from exc
        if len(data) > limit:
            raise RequestError(400, f"{where}: the image at {url} is larger than {limit} bytes")
        return data


def read_turns(messages: list[dict[str, Any]], images: ImageReader) -> tuple[str | None, list[Turn]]:
    """``(system prompt, turns)`` from the request's messages.

    Raises:
        RequestError: a system message after the first turn, an unknown role or part type, an
            empty message, or an unreadable image.
    """
    system: str | None = None
    turns: list[Turn] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        where = f"messages[{i}]"
        if role in ("system", "developer"):
            if turns:
                raise RequestError(400, f"{where}: a system message must come before every other message")
            text = _text_only(message.get("content"), where)
            system = text if system is None else system + "\n" + text
            continue
        if role not in ("user", "assistant", "tool"):
            raise RequestError(400, f"{where}: unknown role {role!r}", param="messages")
        if message.get("tool_calls") or message.get("function_call"):
            raise RequestError(400, f"{where}: assistant tool calls are not served yet", param="messages")
        parts, keys = _parts(message.get("content"), where, images)
        digest = hashlib.sha256(repr((role, keys)).encode()).hexdigest()
        turns.append(Turn(role, tuple(parts), digest))
    if not turns or turns[-1].role != "user":
        raise RequestError(
            400, "the last message must be a user message (the question to answer)", param="messages"
        )
    return system, turns


def _text_only(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(400, f"{where}: a system message takes text only", param="messages")


def _parts(content: Any, where: str, images: ImageReader) -> tuple[list[Any], list[str]]:
    """The message's parts (text, decoded images) and what identifies each (text, image digest)."""
    if isinstance(content, str):
        if not content:
            raise RequestError(400, f"{where}: empty content", param="messages")
        return [content], [content]
    if not isinstance(content, list) or not content:
        raise RequestError(
            400, f"{where}: content must be a string or a non-empty list of parts", param="messages"
        )
    parts: list[Any] = []
    keys: list[str] = []
    for j, part in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = str(part.get("text", ""))
            if text:
                parts.append(text)
                keys.append(text)
        elif kind == "image_url":
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            if not isinstance(url, str):
                raise RequestError(400, f"{here}: image_url needs a url", param="messages")
            image, digest = images.read(url, here)
            parts.append(image)
            keys.append(f"image:{digest}")
        else:
            raise RequestError(
                400, f"{here}: part type {kind!r} is not served (text and image_url are)", param="messages"
            )
    if not parts:
        raise RequestError(400, f"{where}: every part is empty", param="messages")
    return parts, keys
