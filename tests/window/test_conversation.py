"""Conversation windows: messages framed by the model's own chat template, answers exact.

A conversation's token sequence must be the template's own rendering of the same messages, and
under the exact settings every answer must equal the model's own forward over that sequence,
after pushes, replies remembered, open messages, and moves of whole messages.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.backends.decoding import _Stream
from kamera_agent.chunks.chat import ChatTemplate
from kamera_agent.config import WindowConfig
from kamera_agent.errors import (
    ArgumentError,
    DuplicateChunkError,
    InputError,
    SettingsError,
    UnsupportedModelError,
)
from kamera_agent.window import KameraWindow
from tests.backends.test_transformers_backend import images
from tests.window.backends import backend_named

EXACT = 1e-4


def _window(**kwargs: Any) -> KameraWindow:
    backend = backend_named("qwen2_vl")
    return KameraWindow(backend, config=WindowConfig.exact(evicted_pixels="retain"), **kwargs)  # type: ignore[arg-type]


def _sequence_text(window: KameraWindow, query: str | None = None, in_message: bool = False) -> str:
    ids = [window.encoder.anchor().input_ids, *(window.chunk(r).input_ids for r in window.refs)]
    if query is not None:
        ids.append(window.query_ids(query, in_message=in_message))
    text: str = window.encoder.tokenizer.decode(torch.cat(ids))
    while "<|image_pad|><|image_pad|>" in text:  # the template renders one placeholder per image
        text = text.replace("<|image_pad|><|image_pad|>", "<|image_pad|>")
    return text


def _agrees(window: KameraWindow, query: str, in_message: bool = False) -> None:
    chunks = [window.chunk(ref) for ref in window.refs]
    query_ids = window.query_ids(query, in_message=in_message)
    truth = window.backend.reference_prefill(chunks, query_ids, anchor=window.encoder.anchor()).logits
    got = window.ask(query, decode=DecodeConfig(max_new_tokens=1), in_message=in_message).first_logits
    assert float((got - truth).abs().max()) < EXACT


def test_a_conversation_is_the_templates_own_rendering() -> None:
    window = _window(system_prompt="Be terse.")
    pics = images(2, seed=3)
    window.push_message("user", [pics[0], "what is this?"])
    window.push_message("assistant", "a square")
    window.push_message("user", [pics[1]], closed=False)
    tokenizer = window.encoder.tokenizer
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]},
        {"role": "assistant", "content": "a square"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this?"}]},
    ]
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert _sequence_text(window, "and this?", in_message=True) == want
    _agrees(window, "and this?", in_message=True)


def test_a_turn_ending_in_a_tool_output_is_the_templates_rendering_and_answers_like_the_model() -> None:
    window = _window(system_prompt="Use the tools.")
    window.push_message("user", "book a table")
    window.push_message("assistant", '<tool_call>\n{"name": "book", "arguments": {}}\n</tool_call>')
    tokenizer = window.encoder.tokenizer
    messages = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "book a table"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "book", "arguments": {}}\n</tool_call>'},
        {"role": "tool", "content": "booked for 8pm"},
    ]
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = [window.encoder.anchor().input_ids, *(window.chunk(r).input_ids for r in window.refs)]
    ids.append(window.query_ids("booked for 8pm", query_role="tool"))
    assert tokenizer.decode(torch.cat(ids)) == want
    chunks = [window.chunk(ref) for ref in window.refs]
    query_ids = window.query_ids("booked for 8pm", query_role="tool")
    truth = window.backend.reference_prefill(chunks, query_ids, anchor=window.encoder.anchor()).logits
    answer = window.ask(
        "booked for 8pm", decode=DecodeConfig(max_new_tokens=2), query_role="tool", remember=True
    )
    assert float((answer.first_logits - truth).abs().max()) < EXACT
    before = tokenizer.apply_chat_template(messages[:3], add_generation_prompt=False, tokenize=False)
    tool_block = want[len(before) :].removesuffix(window.conversation.template.generation)
    assert tokenizer.decode(window.chunk(window.refs[-2]).input_ids) == tool_block  # remembered as framed
    with pytest.raises(SettingsError, match="query_role"):
        KameraWindow(window.backend).ask("q", query_role="tool")


def test_default_system_prompt_and_remembered_turns_answer_like_the_model() -> None:
    window = _window(conversation=True)
    assert window.encoder.anchor().input_ids.numel() > 0
    pics = images(3, seed=4)
    window.push_message("user", [pics[0], "first"])
    _agrees(window, "what changed?")
    answer = window.ask("what changed?", decode=DecodeConfig(max_new_tokens=3), remember=True)
    assert len(window.refs) == 4  # the question and the answer joined the conversation
    assert window.encoder.tokenizer.decode(window.chunk(window.refs[-1]).input_ids).startswith(
        "<|im_start|>assistant\n" + answer.text
    )
    window.push_message("user", [pics[1], "second"])
    _agrees(window, "and now?")


def test_an_answer_start_is_the_templates_continued_message_and_answers_like_the_model() -> None:
    window = _window(system_prompt="Be terse.")
    window.push_message("user", [images(1, seed=6)[0], "what is this?"])
    opening = 'It is called "'
    tokenizer = window.encoder.tokenizer
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]},
        {"role": "user", "content": "name it"},
        {"role": "assistant", "content": opening},
    ]
    want = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    ids = [window.encoder.anchor().input_ids, *(window.chunk(r).input_ids for r in window.refs)]
    ids.append(window.query_ids("name it", answer_start=opening))
    text = tokenizer.decode(torch.cat(ids))
    while "<|image_pad|><|image_pad|>" in text:
        text = text.replace("<|image_pad|><|image_pad|>", "<|image_pad|>")
    assert text == want
    chunks = [window.chunk(ref) for ref in window.refs]
    truth = window.backend.reference_prefill(
        chunks, window.query_ids("name it", answer_start=opening), anchor=window.encoder.anchor()
    ).logits
    plain = window.ask("name it", decode=DecodeConfig(max_new_tokens=1)).first_logits
    answer = window.ask("name it", decode=DecodeConfig(max_new_tokens=2), answer_start=opening, remember=True)
    assert float((answer.first_logits - truth).abs().max()) < EXACT
    assert float((plain - truth).abs().max()) > 1e-2  # the opening is part of what was asked
    replied = tokenizer.decode(window.chunk(window.refs[-1]).input_ids)
    assert replied.startswith("<|im_start|>assistant\n" + opening + answer.text)  # remembered whole
    with pytest.raises(ArgumentError, match="answer_start"):
        window.ask("name it", answer_start=None)  # type: ignore[arg-type]


def test_a_plain_window_continues_an_answer_start_like_the_model() -> None:
    window = KameraWindow(backend_named("qwen2_vl"), config=WindowConfig.exact())  # type: ignore[arg-type]
    window.push(images(1, seed=7)[0])
    opening = "The colour is"
    ids = window.query_ids("which colour?", answer_start=opening)
    encoder = window.encoder
    assert torch.equal(
        ids,
        encoder.tokens(encoder.prompt.query_prefix + "which colour?" + encoder.prompt.query_suffix + opening),
    )
    inputs = window.as_model_inputs("which colour?", answer_start=opening)
    assert torch.equal(inputs["input_ids"][0, -ids.numel() :], ids)
    truth = window.backend.reference_prefill(
        [window.chunk(window.refs[0])], ids, anchor=encoder.anchor()
    ).logits
    got = window.ask("which colour?", decode=DecodeConfig(max_new_tokens=1), answer_start=opening)
    assert float((got.first_logits - truth).abs().max()) < EXACT


def test_moving_and_dropping_whole_messages_stays_exact() -> None:
    window = _window(system_prompt="Be terse.")
    pics = images(3, seed=5)
    first = window.push_message("user", [pics[0], "one"])
    second = window.push_message("user", [pics[1], "two"])
    third = window.push_message("user", [pics[2], "three"])
    window.reorder([*third, *first, *second])
    _agrees(window, "which came first?")
    window.evict(*first)
    assert len(window.refs) == 4
    _agrees(window, "which is left?")
    window.recall(first[1], at=2)
    window.recall(first[0], at=2)
    _agrees(window, "and now?")


def test_streamed_text_is_the_answer() -> None:
    window = _window(conversation=True)
    window.push_message("user", "hello there")
    pieces: list[str] = []
    answer = window.ask("say something", decode=DecodeConfig(max_new_tokens=6), on_text=pieces.append)
    assert "".join(pieces) == answer.text


def test_a_streamed_stop_string_is_never_sent() -> None:
    sent: list[str] = []
    stream = _Stream(sent.append, ["STOP"])
    for text in ["he", "hel", "hello S", "hello ST", "hello STx"]:
        stream.saw(text)
    assert "".join(sent) == "hello STx"
    sent.clear()
    stream = _Stream(sent.append, ["STOP"])
    for text in ["ab", "ab ST", "ab STO"]:
        stream.saw(text)
    stream.done("ab ")  # the decode loop cut the stop string off
    assert "".join(sent) == "ab "


def test_conversation_errors_say_what_to_do() -> None:
    plain = KameraWindow(backend_named("qwen2_vl"))  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="conversation=True"):
        plain.push_message("user", "hi")
    with pytest.raises(SettingsError, match="conversation=True"):
        plain.ask("hi", remember=True)
    window = _window(conversation=True)
    with pytest.raises(InputError, match="system prompt"):
        window.push_message("system", "be nice")
    with pytest.raises(InputError, match="at least one part"):
        window.push_message("user", [])
    refs = window.push_message("user", ["a", "b"])
    with pytest.raises(DuplicateChunkError):
        window.evict(refs[0], refs[0])
    assert window.refs == refs  # refused: nothing changed


def test_a_template_whose_markers_depend_on_neighbours_is_refused() -> None:
    backend = backend_named("qwen2_vl")

    class Glued:
        """Joins consecutive messages with a marker that names both roles."""

        chat_template = "glued"

        def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
            out, previous = "", "start"
            for message in messages:
                content = message["content"]
                text = content if isinstance(content, str) else "".join(p["text"] for p in content)
                out += f"<{previous}>{message['role']}:{text}"
                previous = message["role"]
            return out + ("<gen>" if kwargs.get("add_generation_prompt") else "")

    with pytest.raises(UnsupportedModelError, match=r"neighbouring messages|unlike"):
        ChatTemplate.from_tokenizer(Glued(), backend.encoder.prompt)


def _string_template_backend() -> Any:
    """The text test model with a tokenizer whose template takes string content only."""
    from kamera_agent.backends.transformers import TransformersBackend
    from tests.templates import CHATML_STRING
    from tests.tiny_processors import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHATML_STRING
    return TransformersBackend(backend_named("qwen2").model, tokenizer=tokenizer)


def test_a_template_taking_string_content_gets_text_messages_as_strings() -> None:
    """SmolLM2's template concatenates ``message['content']``: a list of parts would make it
    raise. A message's parts are joined by a newline, as the template then renders them."""
    backend = _string_template_backend()
    window = KameraWindow(backend, config=WindowConfig.exact(), conversation=True, system_prompt="Be brief.")
    assert window.conversation is not None and window.conversation.template.content_format == "string"
    window.push_message("user", ["the red ball", "rolls left"])
    window.ask("Where?", decode=DecodeConfig(max_new_tokens=2), remember=True)
    window.push_message("user", "and then?")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "the red ball\nrolls left"},
        {"role": "user", "content": "Where?"},
    ]
    rendered = backend.tokenizer.apply_chat_template(messages, tokenize=False)
    assert _sequence_text(window).startswith(rendered)
    _agrees(window, "Now?", in_message=True)


def test_a_template_that_renders_nothing_before_the_first_message_is_refused() -> None:
    backend = _string_template_backend()
    backend.tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(UnsupportedModelError, match=r"bos_token"):
        ChatTemplate.from_tokenizer(backend.tokenizer, backend.encoder.prompt)


def test_a_string_templates_separator_is_a_chunk_so_a_dropped_part_leaves_the_others_as_they_are() -> None:
    """A string-content template joins a message's parts with a newline. Were the newline part
    of the next part's chunk, an agent dropping an old message's first part (a screenshot before
    its text) would make the text a new chunk mid-window, re-formed with everything after it; as
    a chunk of its own, the drop is an eviction of two chunks and the rest stay the same."""
    backend = _string_template_backend()
    window = KameraWindow(backend, config=WindowConfig.exact(), conversation=True, system_prompt="Be brief.")
    conversation = window.conversation
    assert conversation is not None and conversation.template.separator_apart

    def message(parts: list[str], tag: str) -> list[Any]:
        labels = [f"{tag}.{i}" for i in range(len(parts))]
        return conversation.message("user", parts, labels=labels, markers_apart=True)

    both, later = message(["a screen of buttons", "step 1: clicked ok"], "m0"), message(["step 2"], "m1")
    assert [chunk.label for chunk in both] == ["m0.open", "m0.0", "m0.sep1", "m0.1", "m0.close"]
    refs = window.arrange([*both, *later])
    rendered = backend.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "a screen of buttons\nstep 1: clicked ok"},
            {"role": "user", "content": "step 2"},
        ],
        tokenize=False,
    )
    assert _sequence_text(window) == rendered
    text_only = message(["step 1: clicked ok"], "m0")
    assert [chunk.key for chunk in text_only] == [chunk.key for chunk in (both[0], both[3], both[4])]
    plan = window.plan.arrange([refs[0], refs[3], refs[4], *refs[5:]])
    assert plan.count("evict") == 2 and plan.count("admit") == 0
