"""Where chunks sit in the model's own chat template.

Why derived, not hard-coded: a window is one user turn whose content is the chunks, framed
by the model's template. We render the tokenizer's own chat template around sentinels and cut
it into the pieces a window needs: the **anchor** (system prompt and user-turn start, shared by
every window and never relocated), the text that frames each image, and the **query suffix**
that closes the turn and opens the assistant's. A text model without a chat template (a base
model, such as Gemma 3 270M) continues plain text: the anchor is its beginning-of-sequence token,
the chunks and the query follow back to back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kamera_agent.errors import UnsupportedModelError

__all__ = ["PromptFormat"]

_QUERY = "\u2063KAMERA_QUERY\u2063"


@dataclass(frozen=True)
class PromptFormat:
    """The template pieces around window chunks.

    Attributes:
        anchor: text before the first chunk (system prompt, user-turn start).
        image_open: text before an image's placeholder tokens (e.g. ``<|vision_start|>``).
        image_token: the placeholder token repeated once per merged patch (``<|image_pad|>``).
        image_close: text after the placeholders (``<|vision_end|>``).
        query_prefix: text between the last chunk and the query.
        query_suffix: text after the query: end of turn and the assistant's start.
    """

    anchor: str
    image_open: str = ""
    image_token: str | None = None
    image_close: str = ""
    query_prefix: str = ""
    query_suffix: str = ""

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, image_token: str | None = None) -> PromptFormat:
        """Cut the tokenizer's own chat template into window pieces.

        Raises:
            UnsupportedModelError: a vision model's tokenizer, or one without a beginning-of-sequence
                token, has no chat template; pass a `PromptFormat`.
        """
        if not getattr(tokenizer, "chat_template", None):
            bos = getattr(tokenizer, "bos_token", None)
            if image_token is None and isinstance(bos, str) and bos:
                return cls(anchor=bos)  # a base model: plain text after its start token
            raise UnsupportedModelError(
                "the tokenizer has no chat template, so kamera-agent cannot tell where chunks go; pass "
                "PromptFormat(anchor=..., query_suffix=...) explicitly"
            )
        if image_token is None:
            return cls._text_only(tokenizer)
        one = _render(tokenizer, [{"type": "image"}, {"type": "text", "text": _QUERY}])
        two = _render(tokenizer, [{"type": "image"}, {"type": "image"}, {"type": "text", "text": _QUERY}])
        first = one.find(image_token)
        second = two.find(image_token, first + len(image_token))
        if first < 0 or second < 0:
            raise UnsupportedModelError(
                f"the chat template does not render image placeholders as {image_token!r}; "
                "pass a PromptFormat"
            )
        # Two images render as anchor + open + pad + close + open + pad + close + query: the text
        # right before each placeholder that the two share is the opener.
        open_len = _common_suffix(two[:first], two[:second])
        anchor, image_open = one[: first - open_len], one[first - open_len : first]
        image_close, _, query_suffix = one[first + len(image_token) :].partition(_QUERY)
        return cls(anchor, image_open, image_token, image_close, "", query_suffix)

    @classmethod
    def _text_only(cls, tokenizer: Any) -> PromptFormat:
        rendered = _render(tokenizer, _QUERY)  # text-only templates take a plain string
        anchor, _, query_suffix = rendered.partition(_QUERY)
        return cls(anchor=anchor, query_suffix=query_suffix)


def _render(tokenizer: Any, content: Any) -> str:
    rendered: str = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return rendered


def _common_suffix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n
