"""Where a conversation's messages sit in the model's own chat template.

Why each message frames itself: a chat window holds system prompt, user parts, images and
assistant replies as chunks, and moves them (an agent drops an old screenshot, re-sends an
earlier one, reorders two). A chunk whose tokens depended on its neighbours (the previous
turn's closing marker glued to the next turn's opening one) would change identity with every
move, and nothing could be reused. So a message's first chunk carries its role's opening
marker and its last chunk the closing one (``<|im_start|>user\\n`` … ``<|im_end|>\\n`` for
ChatML): the same message is the same chunks wherever it sits.

The **system prompt belongs to the anchor** (the template's start up to the first message):
it is fixed for a conversation, precedes everything, and every chunk's canonical is then
computed behind it, so patches only carry what chunks take from each other, not what they all
take from the system prompt. A different system prompt is a different anchor (and a different
encoder signature: canonicals are not shared across system prompts, as their KV differs).

Everything is derived by rendering the tokenizer's own template around sentinels, as
`PromptFormat` does for one user turn. Templates take a message's content in one of two forms:
a list of typed parts (multimodal templates) or a plain string (ChatML as SmolLM2 ships it, and
most text-only chat models). A string template is given text-only messages as strings, their
parts joined by a newline (what vLLM does for such templates), so a template that concatenates
``message['content']`` as a string works unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Literal

from kamera_agent.chunks.prompt import PromptFormat
from kamera_agent.errors import UnsupportedModelError

__all__ = ["ROLES", "ChatTemplate", "ContentFormat", "Role"]

Role = Literal["user", "assistant", "tool"]
ContentFormat = Literal["parts", "string"]
ROLES: tuple[Role, ...] = ("user", "assistant", "tool")
_A, _B, _SYS = "\u2063KAMERA_A\u2063", "\u2063KAMERA_B\u2063", "\u2063KAMERA_SYSTEM\u2063"


@dataclass(frozen=True)
class ChatTemplate:
    """The template's pieces for messages.

    Attributes:
        default_anchor: the start of a conversation without a system prompt (the template's
            default system block, if it has one).
        system_open / system_close: the text around a system prompt; the anchor of a
            conversation with one is ``system_open + prompt + system_close``.
        opens: each role's opening marker (``<|im_start|>user\\n``).
        closes: each role's closing marker (``<|im_end|>\\n``).
        part_separator: text between two parts of one message (``""`` for ChatML; a newline
            where the template takes string content).
        generation: what opens the assistant's answer (``<|im_start|>assistant\\n``).
        prompt: the single-turn `PromptFormat` (image framing: ``image_open``/``image_close``).
        content_format: how the template takes a message's content: ``"parts"`` (a list of
            typed parts) or ``"string"`` (text only, parts joined by a newline).
        separator_apart: the tokenizer gives text, the separator and text apart the tokens it
            gives them joined, so the separator can be a chunk of its own (`Conversation.message`).
    """

    default_anchor: str
    system_open: str
    system_close: str
    opens: dict[str, str]
    closes: dict[str, str]
    part_separator: str
    generation: str
    prompt: PromptFormat
    content_format: ContentFormat = "parts"
    separator_apart: bool = False

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, prompt: PromptFormat) -> ChatTemplate:
        """Cut the tokenizer's chat template into message pieces.

        Raises:
            UnsupportedModelError: no chat template, or one whose messages do not frame
                themselves (a marker that depends on the neighbouring message).
        """
        if not getattr(tokenizer, "chat_template", None):
            raise UnsupportedModelError(
                "the tokenizer has no chat template (a base model?), so a conversation cannot be framed; "
                "give it one (tokenizer.chat_template = ..., or kamera serve --chat-template FILE), or use "
                "a plain KameraWindow"
            )
        form = _content_format(tokenizer)
        _msg = functools.partial(_message, form=form)
        system = _render(tokenizer, [_msg("system", _SYS)], generation=False)
        system_open, found, system_close = system.partition(_SYS)
        if not found:
            raise UnsupportedModelError(
                "the chat template drops system messages; it cannot hold a system prompt"
            )
        opens: dict[str, str] = {}
        closes: dict[str, str] = {}
        for role in ROLES:
            one = _render(tokenizer, [_msg("system", _SYS), _msg(role, _A)], generation=False)
            head, _, tail = one.partition(_A)
            between = head.partition(_SYS)[2]
            if not head.startswith(system_open + _SYS) or not between.startswith(system_close):
                raise UnsupportedModelError(
                    f"the chat template renders a {role} message unlike its system one"
                )
            opens[role], closes[role] = between[len(system_close) :], tail
        default = _render(tokenizer, [_msg("user", _A)], generation=False).partition(_A)[0]
        if not default.endswith(opens["user"]):
            raise UnsupportedModelError("the chat template frames the first user message unlike later ones")
        if not default[: len(default) - len(opens["user"])]:
            raise UnsupportedModelError(
                "the chat template renders nothing before the first message, and kamera starts every "
                "conversation from the template's own start; begin it with the beginning-of-sequence token "
                "({{ bos_token }}) or a default system block"
            )
        separator = _part_separator(tokenizer, form)
        with_prompt = _render(tokenizer, [_msg("system", _SYS), _msg("user", _A)], generation=True)
        plain = _render(tokenizer, [_msg("system", _SYS), _msg("user", _A)], generation=False)
        if not with_prompt.startswith(plain):
            raise UnsupportedModelError("the chat template's generation prompt rewrites the conversation")
        template = cls(
            default_anchor=default[: -len(opens["user"])] if opens["user"] else default,
            system_open=system_open,
            system_close=system_close,
            opens=opens,
            closes=closes,
            part_separator=separator,
            generation=with_prompt[len(plain) :],
            prompt=prompt,
            content_format=form,
            separator_apart=_tokenizes_apart(tokenizer, separator),
        )
        template._check(tokenizer)
        return template

    def anchor(self, system_prompt: str | None) -> str:
        """The conversation's fixed start: the template's default, or this system prompt's block."""
        if system_prompt is None:
            return self.default_anchor
        return self.system_open + system_prompt + self.system_close

    def prompt_format(self, system_prompt: str | None) -> PromptFormat:
        """The `PromptFormat` of a conversation window: its anchor, image framing, no query framing
        (the conversation frames its own query)."""
        return replace(self.prompt, anchor=self.anchor(system_prompt), query_prefix="", query_suffix="")

    def _check(self, tokenizer: Any) -> None:
        """A whole conversation rendered by the template equals our pieces put together."""
        _msg = functools.partial(_message, form=self.content_format)
        messages = [
            _msg("system", _SYS),
            _msg("user", [_A, _B]),
            _msg("assistant", _A),
            _msg("user", _B),
        ]
        want = _render(tokenizer, messages, generation=True)
        ours = (
            self.anchor(_SYS)
            + self.opens["user"]
            + _A
            + self.part_separator
            + _B
            + self.closes["user"]
            + self.opens["assistant"]
            + _A
            + self.closes["assistant"]
            + self.opens["user"]
            + _B
            + self.closes["user"]
            + self.generation
        )
        if want != ours:
            raise UnsupportedModelError(
                "the chat template's markers depend on neighbouring messages, so its messages cannot move "
                "as chunks; use a plain KameraWindow (one user turn)"
            )


def _part_separator(tokenizer: Any, form: ContentFormat) -> str:
    """What the template puts between two parts of one message."""
    two = _render(tokenizer, [_message("system", _SYS, form), _message("user", [_A, _B], form)], False)
    return two.partition(_A)[2].partition(_B)[0]


_NEIGHBOURS = (("It ends here.", "Next line"), ("a list:", "- one item"), ("step 3", "(12 buttons)"))
"""Texts around a separator: a sentence's end, a list, digits and brackets."""


def _tokenizes_apart(tokenizer: Any, separator: str) -> bool:
    """Whether the texts around a separator and the separator itself tokenize apart as they do
    joined (a tokenizer may merge a newline with punctuation before it or text after it)."""
    if not separator:
        return False

    def tokens(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    return all(
        tokens(before + separator + after) == tokens(before) + tokens(separator) + tokens(after)
        for before, after in _NEIGHBOURS
    )


def _message(role: str, content: str | list[str], form: ContentFormat) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": role, "content": content}
    if form == "string":
        return {"role": role, "content": "\n".join(content)}
    return {"role": role, "content": [{"type": "text", "text": text} for text in content]}


def _content_format(tokenizer: Any) -> ContentFormat:
    """``"parts"`` where the template renders a list of text parts as their text, else
    ``"string"`` (it raises on a list, or prints the list itself)."""
    messages = [_message("system", _SYS, "string"), _message("user", [_A, _B], "parts")]
    try:
        rendered = str(tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False))
    except Exception:  # a template may raise on any shape it does not support
        return "string"
    shown = _A in rendered and _B in rendered and "'type'" not in rendered and '"type"' not in rendered
    return "parts" if shown else "string"


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation: bool) -> str:
    try:
        text: str = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
    except Exception as exc:  # a template may raise on any shape it does not support
        raise UnsupportedModelError(f"the chat template cannot render a conversation: {exc}") from exc
    return text
