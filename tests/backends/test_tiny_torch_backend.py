"""The plain-torch backend against its own model's forward: the seam holds without transformers.

Each check compares a primitive (prefill over placed KV, relocation by the operator, decode over
an assembled cache) with `TinyRopeLM`'s own forward over the whole sequence, and each has a guard
showing the comparison could fail (wrong rotary pairing, no relocation, a different antecedent).

Tolerances: everything is float32 (eps 1.2e-7). Prefill-vs-reference runs the same arithmetic on
the same inputs, so it agrees to a few ulps; relocation adds one unrotate and one rotate (cos/sin
rounded to float32, ~1e-7 each) and the model's own forward at other absolute angles, whose
rounding differs by ~1e-7 per layer: 2e-5 relative leaves two orders of margin over that and is
still three orders below the smallest real effect measured here (> 1e-2).
"""

from __future__ import annotations

import ast
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from kamera_agent.backends.base import DecodeConfig, VisionFeatures
from kamera_agent.backends.tiny_torch import TinyByteTokenizer, TinyImageProcessor, TinyTorchBackend
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.errors import CapabilityError, LayoutMismatchError
from kamera_agent.operator.layout import ChunkKV, relocate, to_position_free
from kamera_agent.operator.rope import RotarySpec

PACKAGE = Path(__file__).resolve().parents[2] / "kamera_agent" / "backends" / "tiny_torch"
KV_TOL = 2e-5  # relative, see the module docstring


@cache
def backend() -> TinyTorchBackend:
    return TinyTorchBackend()


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (24, 20, 3), dtype=np.uint8))


@cache
def chunks() -> tuple[Chunk, Chunk, Chunk]:
    enc = backend().encoder
    return (
        enc.text("The kitchen camera, frame 12:", label="caption"),
        enc.image(picture(0), caption="t=12s "),
        enc.text(" a red mug sits left of the kettle."),
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b``."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def layer_rel(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """`rel` per layer of ``[L, H, n, D]`` tensors."""
    return [rel(x, y) for x, y in zip(a, b, strict=True)]


def vision_of(items: tuple[Chunk, ...] | list[Chunk]) -> list[VisionFeatures]:
    return [backend().encode_vision(c).features for c in items if c.has_vision]


def starts(items: list[Chunk], start: int) -> list[int]:
    out = []
    for chunk in items:
        out.append(start)
        start += chunk.advance
    return out


# -- the layout describes the model's rotation ---------------------------------------------------
def test_layout_rotation_reproduces_model_keys() -> None:
    """`relocate` of a layer-0 key before rotation is the key the model caches (~1e-7), and
    the other pairing is far off, so the layout's ``pairing`` and ``inv_freq`` are what matter."""
    b = backend()
    text = chunks()[0]
    block: Any = b.model.layers[0]
    with torch.no_grad():
        raw = block.attn.k(block.attn_norm(b.model.embed(text.input_ids)))  # [n, Hk * D]
    raw = raw.view(text.num_tokens, *b.layout.keys_shape).transpose(0, 1)[None]  # [1, Hk, n, D]
    free = ChunkKV(raw, raw)
    for start in (0, 4321):
        cached = b.prefill([text], [], start).kv[0].keys[:1]
        where = text.positions_at(start)
        err = rel(relocate(free, b.layout, where).keys, cached)
        assert err < 1e-6, (start, err)
        half = replace(b.layout, rope=RotarySpec(b.layout.rope.inv_freq, "half"))
        assert rel(relocate(free, half, where).keys, cached) > 0.1


# -- (a) relocation: rotation moves a chunk exactly ---------------------------------------------
@pytest.mark.parametrize("offset", [0, 7, 300, 3000])
def test_relocated_kv_equals_model_prefill_there(offset: int) -> None:
    """A run prefilled at 0 and moved by ``offset`` with the operator equals the model's own prefill
    of the run at ``offset``; without the rotation it would not (guard)."""
    b = backend()
    run = [b.encoder.anchor(), *chunks()]
    here = b.prefill(run, [], 0, vision_of(run)).kv
    there = b.prefill(run, [], offset, vision_of(run)).kv
    for kv, want in zip(here, there, strict=True):
        assert want.positions is not None and kv.positions is not None
        torch.testing.assert_close(want.positions, kv.positions + offset, rtol=0, atol=0)
        moved = relocate(to_position_free(kv, b.layout), b.layout, want.positions)
        assert rel(moved.keys, want.keys) <= KV_TOL
        # Values carry no phase; only attention's float32 rounding at other angles reaches them.
        assert rel(moved.values, want.values) <= KV_TOL
        if offset:
            assert rel(kv.keys, want.keys) > 1e-2  # guard: unmoved keys are visibly wrong


# -- (b) prefill over placed context equals the model's full forward -----------------------------
def test_prefill_over_reference_context_equals_reference() -> None:
    """Each chunk (text and image) prefilled over the reference KV before it equals the reference."""
    b = backend()
    items = list(chunks())
    ref = b.reference_prefill(items)
    for i, (chunk, start) in enumerate(zip(items, starts(items, b.encoder.anchor().advance), strict=True)):
        out = b.prefill([chunk], ref.kv[: i + 1], start, vision_of([chunk]))
        assert out.spent.forwards == 1 and out.spent.tokens_prefilled == chunk.num_tokens
        kv, want = out.kv[0], ref.kv[i + 1]
        assert kv.chunk_key == chunk.key == want.chunk_key and kv.model_fingerprint == b.fingerprint
        assert rel(kv.keys, want.keys) <= KV_TOL and rel(kv.values, want.values) <= KV_TOL
        assert want.positions is not None and kv.positions is not None
        assert torch.equal(kv.positions, want.positions)


def test_multi_chunk_prefill_equals_chunk_by_chunk() -> None:
    """One forward over a run equals prefilling it chunk by chunk over the growing placed context,
    and both equal the reference forward."""
    b = backend()
    anchor, items = b.encoder.anchor(), list(chunks())
    anchor_kv = b.prefill([anchor], [], 0).kv[0]
    run = b.prefill(items, [anchor_kv], anchor.advance, vision_of(items))
    assert run.spent.forwards == 1 and run.spent.tokens_prefilled == sum(c.num_tokens for c in items)
    placed = [anchor_kv]
    for chunk, start in zip(items, starts(items, anchor.advance), strict=True):
        placed.append(b.prefill([chunk], placed, start, vision_of([chunk])).kv[0])
    ref = b.reference_prefill(items)
    for one, by_one, want in zip(run.kv, placed[1:], ref.kv[1:], strict=True):
        assert rel(one.keys, by_one.keys) <= KV_TOL and rel(one.values, by_one.values) <= KV_TOL
        assert rel(one.keys, want.keys) <= KV_TOL and rel(one.values, want.values) <= KV_TOL


# -- (c) the model conditions measurably, at depth --------------------------------------------------
def test_chunk_kv_depends_on_its_antecedent() -> None:
    """The same chunk at the same positions behind a different (equal-length) antecedent: layer 0
    is identical (no attention yet), the last layer differs by > 1e-2 relative."""
    b = backend()
    enc, anchor = b.encoder, b.encoder.anchor()
    first, other, tail = enc.text("a cat on a mat"), enc.text("a dog in a fog"), chunks()[2]
    assert first.num_tokens == other.num_tokens
    behind = [b.prefill([anchor, x, tail], [], 0).kv[2] for x in (first, other)]
    keys, values = layer_rel(behind[0].keys, behind[1].keys), layer_rel(behind[0].values, behind[1].values)
    assert keys[0] == 0.0 and values[0] == 0.0
    assert keys[-1] > 1e-2 and values[-1] > 1e-2, (keys, values)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_chunk_kv_at_a_layer_reads_antecedent_kv_below_it(depth: int) -> None:
    """Perturb only the antecedent's KV at layers >= ``depth``: the chunk's KV at layers <= depth is
    bit-identical and at every layer above it differs. With ``depth = 1`` this is conditioning a
    2-layer model cannot show (its chunk KV stops at layer 1)."""
    b = backend()
    anchor, (head, _, tail) = b.encoder.anchor(), chunks()
    anchor_kv, head_kv = b.prefill([anchor, head], [], 0).kv
    generator = torch.Generator().manual_seed(1)

    def noisy(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[depth:] += 0.5 * t[depth:].std() * torch.randn(t[depth:].shape, generator=generator)
        return t

    bent = replace(head_kv, keys=noisy(head_kv.keys), values=noisy(head_kv.values))
    start = anchor.advance + head.advance
    clean = b.prefill([tail], [anchor_kv, head_kv], start).kv[0]
    moved = b.prefill([tail], [anchor_kv, bent], start).kv[0]
    keys, values = layer_rel(moved.keys, clean.keys), layer_rel(moved.values, clean.values)
    assert all(k == 0.0 and v == 0.0 for k, v in zip(keys[: depth + 1], values[: depth + 1], strict=True))
    assert all(k > 1e-2 and v > 1e-2 for k, v in zip(keys[depth + 1 :], values[depth + 1 :], strict=True)), (
        keys,
        values,
    )


# -- (d) decode over an assembled cache ------------------------------------------------------------
def test_decode_over_assembled_reference_kv_equals_full_forwards() -> None:
    """Greedy decode over the assembled reference KV gives the reference forward's first logits and
    the tokens of an independent greedy loop (a full forward from scratch per token)."""
    b = backend()
    items = list(chunks())
    query = b.encoder.query_ids("What is left of the kettle?")
    start = sum(c.advance for c in [b.encoder.anchor(), *items])
    ref = b.reference_prefill(items, query)
    config = DecodeConfig(max_new_tokens=6, return_logits=True)
    decoded = b.decode(b.assemble(b.reference_prefill(items).kv), query, start, config)
    answer = decoded.answer
    # Logits are O(1): 1e-4 absolute is ~1e3 ulps, and greedy picks below have margins >> 1e-4.
    torch.testing.assert_close(answer.first_logits, ref.logits, rtol=0, atol=1e-4)
    tokens: list[int] = []
    steps = []
    for _ in range(config.max_new_tokens):
        logits = b.reference_prefill(items, torch.cat([query, torch.tensor(tokens, dtype=torch.long)])).logits
        steps.append(logits)
        token = int(logits.argmax())
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) > 1e-3  # a margin rounding cannot flip
        if token == b.tokenizer.eos_token_id:
            break
        tokens.append(token)
    assert answer.tokens == tokens
    assert answer.logits is not None
    torch.testing.assert_close(answer.logits, torch.stack(steps[: len(answer.logits)]), rtol=0, atol=1e-4)
    assert decoded.spent.forwards == len(answer.logits)


def test_assemble_and_vision_refuse_what_they_cannot_serve() -> None:
    b = backend()
    text, image, _ = chunks()
    kv = b.prefill([text], [], 0).kv[0]
    with pytest.raises(LayoutMismatchError):
        b.assemble([to_position_free(kv, b.layout)])
    with pytest.raises(CapabilityError):
        b.encode_vision(text)
    with pytest.raises(ValueError, match="image tokens"):
        b.prefill([image], [], 0)  # vision outputs missing
    assert b.assemble([kv, kv]).length == 2 * kv.num_tokens


# -- tokenizer, processor, identity ----------------------------------------------------------------
def test_tokenizer_and_image_processor() -> None:
    tok = TinyByteTokenizer()
    ids = tok("<|bos|><|user|>héllo<|image|>", add_special_tokens=False)["input_ids"]
    assert ids[:2] == [256, 257] and ids[-1] == 260 and len(tok) == 264
    assert tok.decode(ids) == "héllo" and tok.decode(ids, skip_special_tokens=False).startswith("<|bos|>")
    assert tok.convert_tokens_to_ids("<|image|>") == 260 and tok.convert_tokens_to_ids("<|nope|>") is None
    out = TinyImageProcessor()(images=[picture(3)], return_tensors="pt")
    assert out["pixel_values"].shape == (16, 48) and out["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert float(out["pixel_values"].min()) >= 0.0 and float(out["pixel_values"].max()) <= 1.0


def test_seeded_models_are_reproducible_and_distinct() -> None:
    assert TinyTorchBackend(seed=0).fingerprint == backend().fingerprint
    assert TinyTorchBackend(seed=1).fingerprint != backend().fingerprint
    assert backend().layout.kind == "gqa" and backend().context_limit == 8192


# -- (e) no transformers ---------------------------------------------------------------------------
def test_package_imports_no_transformers() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "transformers" or n.startswith("transformers.") for n in names), path
