"""The transformers backend answers exactly like ``model.generate`` when chunks carry exact patches.

Each test assembles a window from canonicals (anchor prefix, images, text) placed with
full-rank patches, decodes a query, and compares with the model's own forward / generate
over the same full conversation. Blind reuse (no patches) must differ measurably, or the
comparison could not fail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from kamera_agent.backends import DecodeConfig, TransformersBackend
from kamera_agent.backends.transformers import eos_token_ids
from kamera_agent.chunks import Chunk
from kamera_agent.core import KVCore
from kamera_agent.operator import ChunkKV, form_patch
from kamera_agent.store import ChunkStore
from tests.kv_helpers import next_token_kl
from tests.tiny_models import ALL_TEXT_FACTORIES, ALL_VL_FACTORIES, tiny_llava
from tests.tiny_processors import (
    tiny_image_processor,
    tiny_llava_image_processor,
    tiny_llava_tokenizer,
    tiny_tokenizer,
)

STEPS = 6


def sharpen(model: Any, std: float = 0.08, seed: int = 0) -> Any:
    """Re-initialise matrices with a larger std: random models at 0.02 barely condition."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "visual" not in name:
                param.normal_(0.0, std)
    return model


@cache
def vl_backend(family: str, layers: int = 2) -> TransformersBackend:
    """A tiny VLM of ``family``; window tests use ``layers=4`` (2-layer models hide conditioning bugs)."""
    if family == "llava":
        llava = sharpen(tiny_llava())
        return TransformersBackend(
            llava, tokenizer=tiny_llava_tokenizer(), image_processor=tiny_llava_image_processor()
        )
    factory = ALL_VL_FACTORIES[family]
    model = sharpen(factory(layers=layers) if layers != 2 else factory())  # type: ignore[call-arg]
    return TransformersBackend(
        model, tokenizer=tiny_tokenizer(), image_processor=tiny_image_processor(family)
    )


@cache
def text_backend(name: str, layers: int = 2) -> TransformersBackend:
    """A tiny text model of ``name``'s family; window and property tests use ``layers=4``, where a
    chunk's KV depends on its antecedents' deeper KV (2-layer models hide such bugs)."""
    factory = ALL_TEXT_FACTORIES[name]
    model = factory(num_hidden_layers=layers) if layers != 2 else factory()  # type: ignore[call-arg]
    return TransformersBackend(sharpen(model), tokenizer=tiny_tokenizer())


def core_of(backend: TransformersBackend, budget: int = 1 << 28) -> KVCore:
    """The engine-neutral core over ``backend`` and a fresh store."""
    return KVCore(backend, ChunkStore(fingerprint=backend.fingerprint, memory_limit=budget))


def images(count: int, seed: int = 0, size: tuple[int, int] = (56, 56)) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)) for _ in range(count)]


def serve(
    backend: TransformersBackend, chunks: Sequence[Chunk], rank: int | str
) -> tuple[list[ChunkKV], int]:
    """Place every chunk after the anchor with a patch of ``rank`` (0: blind); return KVs and the end."""
    core = core_of(backend)
    txn = core.txn()
    placed = [core.anchor_kv(txn.meter)]
    start = core.anchor.advance
    for chunk in chunks:
        canonical = core.canonical(chunk, txn)
        (conditioned,) = core.condition([chunk], placed, start, txn).kv
        patch = form_patch(canonical, conditioned, backend.layout, rank) if rank else None  # type: ignore[arg-type]
        placed.append(core.place(canonical, patch, chunk.positions_at(start)))
        start += chunk.advance
    return placed, start


def check_against_generate(
    backend: TransformersBackend, chunks: Sequence[Chunk], question: str, min_blind_kl: float = 1e-5
) -> None:
    """Exact patches reproduce the model's logits and greedy tokens; blind reuse measurably does not."""
    query = backend.encoder.query_ids(question)
    inputs = backend.reference_inputs(chunks, query)
    with torch.no_grad():
        reference = backend.model(**inputs).logits[0, -1]
        generated = backend.model.generate(**inputs, max_new_tokens=STEPS, do_sample=False)
    expected = generated[0, inputs["input_ids"].shape[1] :].tolist()

    placed, end = serve(backend, chunks, "full")
    answer = backend.decode(backend.assemble(placed), query, end, DecodeConfig(max_new_tokens=STEPS)).answer
    torch.testing.assert_close(answer.first_logits, reference.float(), rtol=0, atol=1e-4)
    eos = eos_token_ids(backend.model, backend.tokenizer)
    until_eos = [t for t in expected[: next((i for i, t in enumerate(expected) if t in eos), len(expected))]]
    assert answer.tokens == until_eos

    blind, end = serve(backend, chunks, 0)
    blind_answer = backend.decode(backend.assemble(blind), query, end, DecodeConfig(max_new_tokens=1)).answer
    assert next_token_kl(reference, blind_answer.first_logits) > min_blind_kl


@pytest.mark.parametrize("family", [*sorted(ALL_VL_FACTORIES), "llava"])
def test_vl_window_with_exact_patches_answers_like_generate(family: str) -> None:
    backend = vl_backend(family)
    pictures = images(3)
    enc = backend.encoder
    chunks = [
        enc.image(pictures[0], kind="frame", caption="<0.0 seconds>"),
        enc.image(pictures[1], kind="screenshot"),
        enc.text("The red square moved left."),
        enc.image(pictures[2], kind="page"),
    ]
    check_against_generate(backend, chunks, "Where did the square go?")


@pytest.mark.parametrize("name", ["qwen2", "llama", "deepseek_v3", "deepseek_v2"])
def test_text_window_with_exact_patches_answers_like_generate(name: str) -> None:
    backend = text_backend(name)
    enc = backend.encoder
    chunks = [
        enc.text("Alice keeps the key in the blue box."),
        enc.text("Bob took the box."),
        enc.text("Q: key?"),
    ]
    check_against_generate(backend, chunks, "Who has the key?")


def test_non_square_images_place_their_grid_rows() -> None:
    backend = vl_backend("qwen2_vl")
    chunk = backend.encoder.image(images(1, size=(84, 140))[0])
    assert chunk.relative_positions.shape == (3, chunk.num_tokens)
    h, w = (int(x) // 2 for x in chunk.image_grid_thw[0, 1:])  # type: ignore[index]
    assert h != w
    assert chunk.advance == 1 + max(h, w) + 1  # vision_start, the grid, vision_end
    check_against_generate(backend, [chunk, backend.encoder.text("and then")], "What shape?")


def test_vision_tower_runs_once_per_distinct_image() -> None:
    backend = vl_backend("qwen2_5_vl")
    core = core_of(backend)
    picture = images(1, seed=9)[0]
    first = backend.encoder.image(picture)
    second = backend.encoder.image(picture, caption="again")  # other tokens, same pixels
    assert first.vision_key == second.vision_key and first.key != second.key
    txn = core.txn()
    core.anchor_kv(txn.meter)
    spent_before = txn.meter.spent
    core.canonical(first, txn)
    core.canonical(second, txn)
    spent = txn.meter.spent
    assert spent.vision_encodes - spent_before.vision_encodes == 1  # the second one's output is stored
    assert spent.forwards - spent_before.forwards == 2


def test_prefill_reports_what_it_ran_and_matches_the_models_own_forward() -> None:
    backend = text_backend("qwen2", layers=4)
    chunks = [backend.encoder.text("one two three"), backend.encoder.text("four five")]
    reference = backend.reference_prefill(chunks)
    done = backend.prefill(chunks, [reference.kv[0]], backend.anchor.advance)
    assert (done.spent.forwards, done.spent.tokens_prefilled) == (1, sum(c.num_tokens for c in chunks))
    for ours, truth in zip(done.kv, reference.kv[1:], strict=True):
        torch.testing.assert_close(ours.keys, truth.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours.values, truth.values, rtol=0, atol=1e-5)


SAMPLERS: dict[str, Callable[[], DecodeConfig]] = {
    "greedy": lambda: DecodeConfig(max_new_tokens=4),
    "sampled": lambda: DecodeConfig(max_new_tokens=4, temperature=0.8, top_k=20, top_p=0.9, seed=3),
}


@pytest.mark.parametrize("mode", sorted(SAMPLERS))
def test_decoding_is_reproducible(mode: str) -> None:
    backend = text_backend("qwen2")
    chunks = [backend.encoder.text("one two three")]
    query = backend.encoder.query_ids("count")
    runs = []
    for _ in range(2):
        placed, end = serve(backend, chunks, "full")
        runs.append(backend.decode(backend.assemble(placed), query, end, SAMPLERS[mode]()).answer)
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 4


def test_stop_strings_end_the_answer_before_the_stop_text() -> None:
    backend = text_backend("qwen2")
    chunks = [backend.encoder.text("one two three")]
    query = backend.encoder.query_ids("count")
    placed, end = serve(backend, chunks, "full")
    free = backend.decode(backend.assemble(placed), query, end, DecodeConfig(max_new_tokens=8)).answer
    assert len(free.text) >= 3, free.text
    stop = free.text[2]
    placed, end = serve(backend, chunks, "full")
    stopped = backend.decode(
        backend.assemble(placed), query, end, DecodeConfig(max_new_tokens=8, stop=(stop,))
    ).answer
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
