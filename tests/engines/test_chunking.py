"""Engine requests are cut where the model's own chat template opens a message (issue 34, item 3):
ChatML, Llama 3, Gemma and Mistral-style templates, each on a byte tokenizer with that family's
special tokens; before, only ``<|im_start|>`` was known and every other family's prompt was one
chunk, which nothing but a prefix cache can reuse."""

from __future__ import annotations

from typing import Any

import pytest

from kamera_agent.engines.chunking import ChunkRules, message_starts, request_chunks
from kamera_agent.models.tiny_tokenizer import build_byte_tokenizer
from tests.templates import LLAMA_STYLE, SPECIALS

GEMMA_STYLE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + m['content'] + '<end_of_turn>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
MISTRAL_STYLE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{- '[INST] ' + m['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + m['content'] + eos_token }}{%- endif %}{%- endfor %}"
)


def _tokenizer(family: str) -> Any:
    if family == "chatml":
        return build_byte_tokenizer(vocab_size=1024)
    if family == "llama3":
        return build_byte_tokenizer(SPECIALS, LLAMA_STYLE, vocab_size=512)
    specials = (
        {"<bos>": 300, "<eos>": 301, "<start_of_turn>": 302, "<end_of_turn>": 303}
        if family == "gemma"
        else {"<s>": 300, "</s>": 301, "[INST]": 302, "[/INST]": 303}
    )
    tokenizer = build_byte_tokenizer(
        specials, GEMMA_STYLE if family == "gemma" else MISTRAL_STYLE, vocab_size=512
    )
    tokenizer.bos_token, tokenizer.eos_token = list(specials)[:2]
    return tokenizer


MARKERS = {
    "chatml": {"<|im_start|>"},
    "llama3": {"<|start_header_id|>"},
    "gemma": {"<start_of_turn>"},
    "mistral": {"[INST]", "[/INST]"},  # [/INST] opens the assistant's turn: the only marker it has
}


@pytest.mark.parametrize("family", list(MARKERS))
def test_messages_are_cut_at_the_templates_own_marker(family: str) -> None:
    tokenizer = _tokenizer(family)
    starts = message_starts(tokenizer)
    assert starts == {tokenizer.convert_tokens_to_ids(marker) for marker in MARKERS[family]}
    messages = [
        {"role": "user", "content": "open the page"},
        {"role": "assistant", "content": "opened"},
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "open the page"},
    ]
    tokens = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    chunks = request_chunks(tokens, [], ChunkRules(message_starts=starts), "tenant")
    texts = [tokenizer.decode(tokens[c.start : c.end]) for c in chunks]
    said = [m["content"] for m in messages]
    contents = [next((text for text in dict.fromkeys(said) if text in chunk), None) for chunk in texts]
    assert [content for content in contents if content] == said  # one message per chunk, in order
    assert all(sum(text in chunk for text in set(said)) <= 1 for chunk in texts)
    assert "".join(texts) == tokenizer.decode(tokens)
    again = [c.key for c, content in zip(chunks, contents, strict=True) if content == "open the page"]
    assert len(again) == 2 and again[0] == again[1]  # the same message, the same key, wherever it sits


def test_no_template_falls_back_to_chatml_or_no_cuts() -> None:
    chatml = build_byte_tokenizer(vocab_size=1024)
    chatml.chat_template = None
    assert message_starts(chatml) == {chatml.convert_tokens_to_ids("<|im_start|>")}
    plain = build_byte_tokenizer({"<s>": 300}, "{{ messages[0]['content'] }}", vocab_size=512)
    assert message_starts(plain) == frozenset()
