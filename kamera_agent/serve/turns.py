"""Chat messages into turns: validated and identified at the edge, nothing decoded yet.

Why not decode here: a conversation re-sends its whole history every turn. A turn is
identified by a digest of its role and parts (text, and each image URL's digest), so a message
the server has prepared before is recognised without reading its images again
(`kamera_agent.serve.messages`); only new messages' images are fetched and decoded, by
`ImageReader`, under the server's `MediaAccess`, into a byte-bounded cache.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

from kamera_agent.chunks.sources import MAX_IMAGE_PIXELS
from kamera_agent.serve.bounds import TextBound
from kamera_agent.serve.lru import ByteLRU
from kamera_agent.serve.media import MediaAccess, read_url
from kamera_agent.serve.pixels import PixelLease
from kamera_agent.serve.protocol import RequestError
from kamera_agent.serve.tools import HERMES, ToolFormat

__all__ = ["ImagePart", "ImageReader", "Limits", "Turn", "read_turns"]


@dataclass(frozen=True)
class Limits:
    """How much one request may carry.

    Attributes:
        max_messages: messages in a request.
        max_parts: parts in one message.
    """

    max_messages: int = 1024
    max_parts: int = 64


@dataclass(frozen=True)
class ImagePart:
    """An image part as sent: its URL, where it is in the request, and the URL's digest."""

    url: str
    where: str
    digest: str


@dataclass(frozen=True)
class Turn:
    """One message: its role, its parts (``str`` text or `ImagePart`), and a digest of both."""

    role: str
    parts: tuple[str | ImagePart, ...]
    digest: str


class ImageReader:
    """Decodes image parts, keeping decoded images within a byte limit (a conversation re-sends
    the same images; decoding each again would be wasted). Thread-safe: requests are read
    concurrently, outside the model lock.

    Args:
        access: where image URLs may be read from.
        max_pixels: images larger than this are refused before their pixels are decoded.
        limit: bytes of decoded pixels kept (least recently used dropped first).
    """

    def __init__(
        self, access: MediaAccess, max_pixels: int = MAX_IMAGE_PIXELS, limit: int = 64 << 20
    ) -> None:
        self.access, self.max_pixels = access, max_pixels
        self._cache: ByteLRU[tuple[str, str], Image.Image] = ByteLRU(limit, _image_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes of decoded pixels held now."""
        return self._cache.nbytes

    def read(self, part: ImagePart, lease: PixelLease, scope: str = "") -> Image.Image:
        """The part's image, RGB, its decoding charged to ``lease`` first; kept under ``scope``
        (a tenant's namespace: another tenant's copy is never served, nor its decoding spared).

        Raises:
            RequestError: 400 for anything unreadable or not allowed; 429 when the pixel limits
                have no room for it now.
        """
        cached = self._cache.get((scope, part.digest))
        if cached is not None:
            lease.take(cached.width, cached.height, part.where)  # preprocessing it costs as much
            return cached
        image = self._decode(read_url(part.url, part.where, self.access), part.where, lease)
        self._cache.put((scope, part.digest), image)
        return image

    def _decode(self, data: bytes, where: str, lease: PixelLease) -> Image.Image:
        try:
            opened = Image.open(io.BytesIO(data))
            width, height = opened.size  # from the header: checked before the pixels are decoded
            if width * height > self.max_pixels or width <= 0 or height <= 0:
                raise RequestError(
                    400,
                    f"{where}: a {width}x{height} image is outside 1..{self.max_pixels:,} pixels; resize it",
                )
            lease.take(width, height, where)
            opened.load()
            return opened if opened.mode == "RGB" else opened.convert("RGB")  # no copy of RGB
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise RequestError(400, f"{where}: the image does not decode", param="messages") from exc


def _image_bytes(image: Image.Image) -> int:
    return image.width * image.height * 4  # PIL holds RGB in 4 bytes a pixel


def read_turns(
    messages: list[dict[str, Any]],
    limits: Limits = Limits(),
    tool_format: ToolFormat = HERMES,
    text: TextBound | None = None,
    *,
    continues: bool = False,
) -> tuple[str | None, list[Turn]]:
    """``(system prompt, turns)`` from the request's messages (nothing fetched, decoded or
    tokenized); an assistant message's ``tool_calls`` become its text in ``tool_format``, a
    ``tool`` message is a turn of role ``tool`` (the last message is the question: a user's, or
    a tool's output; with ``continues``, the one before a last assistant message whose text the
    answer continues). ``text``: each text, and all of them together, must be short enough to
    fit the model's context (`TextBound`).

    Raises:
        RequestError: too many messages or parts, a text too long for the context, a system
            message after the first turn, an unknown role or part type, an empty message, or a
            last message of another role than the above.
    """
    if len(messages) > limits.max_messages:
        raise RequestError(
            400, f"{len(messages)} messages is over the limit of {limits.max_messages}", param="messages"
        )
    bound = text or TextBound(None)
    system: str | None = None
    turns: list[Turn] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role in ("system", "developer"):
            if turns:
                raise RequestError(400, f"{where}: a system message must come before every other message")
            said = _text_only(message.get("content"), where)
            bound.check(len(said), where)
            system = said if system is None else system + "\n" + said
            continue
        parts = _message_parts(message, where, limits, tool_format, bound)
        keys = [part if isinstance(part, str) else f"image:{part.digest}" for part in parts]
        digest = hashlib.sha256(repr((role, keys)).encode()).hexdigest()
        turns.append(Turn(str(role), tuple(parts), digest))
    every = len(system or "") + sum(
        len(part) for turn in turns for part in turn.parts if isinstance(part, str)
    )
    bound.check(every, "messages (their text together)")
    if continues and (not turns or turns[-1].role != "assistant" or not _texts(turns[-1])):
        raise RequestError(
            400,
            "continue_final_message continues the last message: it must be an assistant message of text",
            param="messages",
        )
    asked = turns[:-1] if continues else turns
    if not asked or asked[-1].role not in ("user", "tool"):
        raise RequestError(
            400,
            f"the {'message before the continued one' if continues else 'last message'} must be a user "
            "message (the question) or a tool message (the output the model answers)",
            param="messages",
        )
    return system, turns


def _texts(turn: Turn) -> bool:
    return all(isinstance(part, str) for part in turn.parts)


def _message_parts(
    message: Any, where: str, limits: Limits, tool_format: ToolFormat, bound: TextBound
) -> list[str | ImagePart]:
    """A user, assistant or tool message's parts, each text bounded by its length."""
    if not isinstance(message, dict):
        raise RequestError(400, f"{where}: a message is an object with a role", param="messages")
    role = message.get("role")
    if role not in ("user", "assistant", "tool"):
        raise RequestError(400, f"{where}: unknown role {role!r}"[:200], param="messages")
    if message.get("function_call"):
        raise RequestError(
            400, f"{where}: function_call is the deprecated form; send tool_calls", param="messages"
        )
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise RequestError(
                400, f"{where}: tool_calls is a list of calls on an assistant message", param="messages"
            )
        for j, call in enumerate(calls):  # bounded before the arguments are parsed
            function = call.get("function", call)
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                bound.check(len(arguments), f"{where}.tool_calls[{j}].function.arguments")
        content = message.get("content")
        said = _text_only(content, where) if content else None
        rendered = tool_format.render(said, calls, where)  # as the template renders them
        bound.check(len(rendered), f"{where} (its calls written out)")
        return [rendered]
    return _parts(message.get("content"), where, limits, bound)


def _text_only(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(400, f"{where}: this message takes text only", param="messages")


def _parts(content: Any, where: str, limits: Limits, bound: TextBound) -> list[str | ImagePart]:
    """The message's parts: text (each bounded by its length), and image parts identified by
    their URL's digest."""
    if isinstance(content, str):
        if not content:
            raise RequestError(400, f"{where}: empty content", param="messages")
        bound.check(len(content), f"{where}.content")
        return [content]
    if not isinstance(content, list) or not content:
        raise RequestError(
            400, f"{where}: content must be a string or a non-empty list of parts", param="messages"
        )
    if len(content) > limits.max_parts:
        raise RequestError(
            400, f"{where}: {len(content)} parts is over the limit of {limits.max_parts}", param="messages"
        )
    parts: list[str | ImagePart] = []
    for j, part in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text", "")
            if not isinstance(text, str):
                raise RequestError(400, f"{here}: text must be a string", param="messages")
            bound.check(len(text), here)
            if text:
                parts.append(text)
        elif kind == "image_url":
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            if not isinstance(url, str):
                raise RequestError(400, f"{here}: image_url needs a url", param="messages")
            parts.append(ImagePart(url, here, hashlib.sha256(url.encode()).hexdigest()))
        else:
            shown = kind if isinstance(kind, str) else type(kind).__name__
            raise RequestError(
                400,
                f"{here}: part type {shown[:40]!r} is not served (text and image_url are)",
                param="messages",
            )
    if not parts:
        raise RequestError(400, f"{where}: every part is empty", param="messages")
    return parts
