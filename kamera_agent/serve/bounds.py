"""What a request may hold, checked before it costs: text by its length, schemas by their size.

Why characters: a tokenizer needs about 200 bytes of memory per byte of text, and a token count
exists only after it has run, so counting tokens first means tokenizing a message of any size
whole just to refuse it. No token covers more bytes than the tokenizer's longest token, and no character is
less than a byte, so a text longer than the context × that many characters cannot fit the
context whatever it says: `TextBound` refuses it by its length before any tokenizer sees it
(each message, the question, the system prompt, rendered tools; the whole conversation too).

Why schemas by expansion as well as size: what a grammar compiler builds from a schema can be
far larger than its text (an ``allOf`` of ``anyOf`` s intersects into the product of their
branches), so `SchemaBound` counts the nodes a compiler expands, refs within an ``allOf``
followed, and refuses past a limit, before anything is compiled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kamera_agent.serve.protocol import RequestError

__all__ = ["SchemaBound", "TextBound", "longest_token_bytes"]

_MAX_DEPTH = 64
"""Schema nesting counted at most (deeper: refused; OpenAI takes 10 levels)."""


def longest_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes any token of ``tokenizer`` stands for, over-counted where the
    vocabulary spells bytes with wider characters (byte-level BPE's ``Ġ``, SentencePiece's
    ``▁``): an over-count only loosens the bound, never refuses a text that fits."""
    vocabulary = tokenizer.get_vocab()
    return max((_nbytes(token) for token in vocabulary), default=1)


def _nbytes(token: str | bytes) -> int:
    return len(token) if isinstance(token, bytes) else len(token.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class TextBound:
    """The most characters a text sent to a model of ``context`` tokens can have and still fit.

    Attributes:
        context: the model's context in tokens (``None``: unbounded, nothing refused).
        token_bytes: the tokenizer's longest token in bytes.
    """

    context: int | None
    token_bytes: int = 1

    @property
    def chars(self) -> int | None:
        """The limit in characters (``None``: none)."""
        return None if self.context is None else self.context * self.token_bytes

    def check(self, length: int, where: str, param: str = "messages") -> None:
        """Refuse ``length`` characters at ``where`` if they cannot fit the context.

        Raises:
            RequestError: 400 ``context_length_exceeded``, naming ``where``.
        """
        limit = self.chars
        if limit is not None and length > limit:
            raise RequestError(
                400,
                f"{where}: {length:,} characters cannot fit the model's context of {self.context:,} "
                f"tokens (at most {limit:,} characters: {self.token_bytes} bytes per token at most); "
                "shorten it",
                param=param,
                code="context_length_exceeded",
            )


@dataclass(frozen=True)
class SchemaBound:
    """How large a JSON schema may be before it is compiled into a grammar.

    Attributes:
        max_chars: its JSON text, in characters.
        max_nodes: the nodes a compiler expands it into (`expansion`).
    """

    max_chars: int = 1 << 17
    max_nodes: int = 10_000

    def check(self, schema: Any, where: str, param: str) -> None:
        """Refuse ``schema`` if its text or its expansion is over the bound.

        Raises:
            RequestError: 400 naming ``where``.
        """
        try:
            chars = len(json.dumps(schema, ensure_ascii=False))
        except (RecursionError, ValueError, TypeError) as exc:
            raise RequestError(400, f"{where}: not a schema the server can read", param=param) from exc
        if chars > self.max_chars:
            raise RequestError(
                400, f"{where}: {chars:,} characters is over the limit of {self.max_chars:,}", param=param
            )
        nodes = expansion(schema, self.max_nodes)
        if nodes > self.max_nodes:
            raise RequestError(
                400,
                f"{where}: the schema expands to over {self.max_nodes:,} nodes or nests past "
                f"{_MAX_DEPTH} levels (an allOf of anyOfs multiplies its branches); simplify it",
                param=param,
            )


def expansion(schema: Any, limit: int) -> int:
    """Nodes a grammar compiler builds from ``schema``: every value once (a ``$ref`` once: it is
    compiled as a rule), and each ``allOf`` as the product of its parts' alternatives (an
    intersection distributes over unions); counting stops past ``limit`` (returns ``limit + 1``)
    and past `_MAX_DEPTH` levels."""
    return _Expansion(schema, limit).size(schema, 0)


class _Expansion:
    def __init__(self, root: Any, limit: int) -> None:
        self.root, self.limit = root, limit

    def size(self, node: Any, depth: int) -> int:
        if depth > _MAX_DEPTH:
            return self.limit + 1
        if not isinstance(node, (dict, list)):
            return 1
        total = 1
        for value in node.values() if isinstance(node, dict) else node:
            total = self._capped(total + self.size(value, depth + 1))
            if total > self.limit:
                return total  # over: no need to count the rest
        parts = node.get("allOf") if isinstance(node, dict) else None
        if isinstance(parts, list) and parts:
            total += self._product(self.alternatives(part, depth + 1, frozenset()) for part in parts)
        return self._capped(total)

    def alternatives(self, node: Any, depth: int, seen: frozenset[str]) -> int:
        """How many branches ``node`` is a union of (refs followed, each once per path)."""
        if depth > _MAX_DEPTH:
            return self.limit + 1
        if not isinstance(node, dict):
            return 1
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in seen:
            return self.alternatives(self._resolve(ref), depth + 1, seen | {ref})
        branches = [b for key in ("anyOf", "oneOf") for b in _listed(node.get(key))]
        count = sum(self.alternatives(b, depth + 1, seen) for b in branches) if branches else 1
        kinds = node.get("type")
        if isinstance(kinds, list):
            count *= max(1, len(kinds))
        inner = _listed(node.get("allOf"))
        if inner:
            count *= self._product(self.alternatives(part, depth + 1, seen) for part in inner)
        return self._capped(count)

    def _resolve(self, ref: str) -> Any:
        """A local ref's target (``#/$defs/x``); anything else stands for one alternative."""
        if not ref.startswith("#/"):
            return None
        node = self.root
        for key in ref[2:].split("/"):
            key = key.replace("~1", "/").replace("~0", "~")
            node = node.get(key) if isinstance(node, dict) else None
        return node

    def _product(self, counts: Any) -> int:
        total = 1
        for count in counts:
            total = self._capped(total * count)
        return total

    def _capped(self, count: int) -> int:
        return min(count, self.limit + 1)


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
