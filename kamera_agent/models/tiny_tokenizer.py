"""A byte-level tokenizer with Qwen-style chat specials, built offline in milliseconds.

Why: the tests and the demo model need a real ``transformers`` tokenizer (chat template,
special tokens, ``save_pretrained``/``from_pretrained``) but nothing may be downloaded. A
byte-level vocabulary needs no training and no data: token ``i`` for ``i < 256`` *is* byte
``i``, so every UTF-8 string encodes and decodes back exactly, and the whole tokenizer is a
pure function of its arguments (deterministic, identical on every machine).

The default special tokens and chat template mirror Qwen2-VL's, with the vision ids of the
tiny test models (image 500, video 501, vision start 502, vision end 503) inside a 512-token
vocabulary, so prompts rendered here have the same structure as the real model's prompts.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "DEFAULT_SPECIAL_TOKENS",
    "DEFAULT_VOCAB_SIZE",
    "NUM_BYTE_TOKENS",
    "QWEN2_VL_CHAT_TEMPLATE",
    "build_byte_tokenizer",
]

NUM_BYTE_TOKENS = 256
DEFAULT_VOCAB_SIZE = 512

# Qwen's chat specials. The vision ids match the tiny Qwen-VL test models' config
# (image_token_id, video_token_id, vision_start_token_id, vision_end_token_id).
DEFAULT_SPECIAL_TOKENS: Mapping[str, int] = {
    "<|endoftext|>": 256,
    "<|im_start|>": 257,
    "<|im_end|>": 258,
    "<|image_pad|>": 500,
    "<|video_pad|>": 501,
    "<|vision_start|>": 502,
    "<|vision_end|>": 503,
}

# Qwen2-VL-Instruct's chat template (its chat_template.json), verbatim: a default system
# prompt when the first message is not a system one, ``<|im_start|>role\n...<|im_end|>\n``
# turns, each image as ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor later
# expands the one pad to the image's token count), optional "Picture N: " labels.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_EOS_TOKEN = "<|im_end|>"
_PAD_TOKEN = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of the ByteLevel pre-tokenizer.

    Why: the ByteLevel pre-tokenizer rewrites each byte as one printable character before the
    model sees it, so the vocabulary must be keyed by these characters. Printable Latin-1 bytes
    map to themselves; the other 68 bytes map, in byte order, to code points 256, 257, ...
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(NUM_BYTE_TOKENS):
        if b not in table:
            table[b] = chr(NUM_BYTE_TOKENS + shifted)
            shifted += 1
    return table


def _check_specials(special_tokens: Mapping[str, int], vocab_size: int) -> None:
    """Raise ``ValueError`` unless the specials have distinct ids in ``[256, vocab_size)``."""
    ids = list(special_tokens.values())
    if len(set(ids)) != len(ids):
        raise ValueError(f"special token ids must be distinct, got {dict(special_tokens)}")
    for name, token_id in special_tokens.items():
        if not name:
            raise ValueError("special token names must be non-empty")
        if not NUM_BYTE_TOKENS <= token_id < vocab_size:
            raise ValueError(
                f"special token {name!r} has id {token_id}; ids 0..{NUM_BYTE_TOKENS - 1} are the bytes"
                f" and the vocabulary has {vocab_size} ids"
            )


def _added_tokens(specials: dict[str, int], vocab_size: int) -> dict[str, int]:
    """The specials, checked, and a reserved filler at every other id past the bytes."""
    _check_specials(specials, vocab_size)
    used = set(specials.values())
    reserved = {f"<|reserved_{i}|>": i for i in range(NUM_BYTE_TOKENS, vocab_size) if i not in used}
    if clash := set(reserved) & set(specials):
        raise ValueError(f"special tokens {sorted(clash)} collide with the reserved filler names")
    return {**specials, **reserved}


def build_byte_tokenizer(
    special_tokens: Mapping[str, int] | None = None,
    chat_template: str | None = None,
    model_max_length: int = 131072,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> PreTrainedTokenizerFast:
    """Build a byte-level fast tokenizer with special tokens at fixed ids, without any download.

    Ids ``0..255`` are the bytes (a BPE model with no merges behind the ByteLevel
    pre-tokenizer and decoder), so ``decode(encode(text)) == text`` for any UTF-8 text. Each
    special token is an added token at its given id and always encodes to that single id.
    Every other id below ``vocab_size`` is a special ``<|reserved_{id}|>`` token, so the
    tokenizer has exactly ``vocab_size`` ids and any id a model of that vocabulary emits
    decodes to something (and is dropped by ``skip_special_tokens=True``).

    Args:
        special_tokens: token text -> id, ids in ``[256, vocab_size)``; ``None`` gives
            `DEFAULT_SPECIAL_TOKENS` (Qwen's chat and vision specials).
        chat_template: a Jinja chat template; ``None`` gives `QWEN2_VL_CHAT_TEMPLATE`, which
            expects the default specials' ``<|im_start|>``/``<|im_end|>``/vision tokens.
        model_max_length: the longest input the tokenizer reports as valid.
        vocab_size: the number of ids (the model's embedding rows).

    Returns:
        The tokenizer. Its eos token is ``<|im_end|>`` and its pad token ``<|endoftext|>``
        when those are among the specials (as in Qwen's instruct models), else unset.

    Raises:
        ValueError: duplicate special ids, an id outside ``[256, vocab_size)``, an empty
            special name, or a special named like one of the reserved fillers.
    """
    specials = dict(DEFAULT_SPECIAL_TOKENS if special_tokens is None else special_tokens)
    added = _added_tokens(specials, vocab_size)
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(NUM_BYTE_TOKENS)}
    # The added tokens are in the model vocabulary too: `add_special_tokens` reuses an id the
    # model already has for the text, which is what pins each special to its requested id
    # (otherwise added tokens get the next free ids in insertion order).
    vocab.update(added)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No merges, so regex pre-splitting would change nothing: every byte is its own token.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    ordered = sorted(added, key=added.__getitem__)
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in ordered])

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=_EOS_TOKEN if _EOS_TOKEN in specials else None,
        pad_token=_PAD_TOKEN if _PAD_TOKEN in specials else None,
        chat_template=QWEN2_VL_CHAT_TEMPLATE if chat_template is None else chat_template,
        model_max_length=model_max_length,
        # Byte-level decoding is already exact; the cleanup would delete spaces before punctuation.
        clean_up_tokenization_spaces=False,
    )
