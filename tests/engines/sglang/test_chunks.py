"""A request's tokens cut into chunks as a window cuts what it is given, with SGLang's own pad values."""

from __future__ import annotations

import itertools

from kamera_agent.demo.model import DEMO_MODEL_DIR
from kamera_agent.engines.sglang.segments import ChunkRules, request_chunks

OPEN, CLOSE, MSG = 7, 8, 5


def _pads(seed: int, n: int) -> list[int]:
    from sglang.srt.managers import schedule_batch

    values = schedule_batch._compute_pad_values(bytes([seed]) * 32)
    return [values[i % len(values)] for i in range(n)]


def test_images_take_their_framing_and_messages_are_cut_at_their_markers() -> None:
    rules = ChunkRules(image_open=OPEN, image_close=CLOSE, message_starts=frozenset({MSG}))
    system = [MSG, 20, 21, 22]
    user = [MSG, 30, 31, OPEN, *_pads(1, 6), CLOSE, 32]
    other = [MSG, 40, OPEN, *_pads(2, 4), CLOSE]
    tokens = [*system, *user, *other, 50]
    chunks = request_chunks(tokens, rules, "ns")
    spans = [tokens[c.start : c.end] for c in chunks]
    assert spans == [
        system,
        [MSG, 30, 31],
        [OPEN, *_pads(1, 6), CLOSE],
        [32],
        [MSG, 40],
        [OPEN, *_pads(2, 4), CLOSE],
        [50],
    ]
    assert chunks[0].start == 0 and chunks[-1].end == len(tokens)
    assert all(a.end == b.start for a, b in itertools.pairwise(chunks))

    moved = [*system, MSG, 40, OPEN, *_pads(1, 6), CLOSE, 60]  # the first image elsewhere, after other text
    again = request_chunks(moved, rules, "ns")
    assert chunks[2].key in {c.key for c in again}  # an image's key is its content, wherever it sits
    assert chunks[2].key not in {c.key for c in request_chunks(moved, rules, "other-tenant")}
    assert chunks[4].key == again[1].key  # the same message text, the same key


def test_rules_come_from_the_models_config_and_tokenizer() -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(DEMO_MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    rules = ChunkRules.for_model(config, tokenizer)
    assert (
        rules.image_open == config.vision_start_token_id and rules.image_close == config.vision_end_token_id
    )
    assert rules.message_starts == {tokenizer.convert_tokens_to_ids("<|im_start|>")}
