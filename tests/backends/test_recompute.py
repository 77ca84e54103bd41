"""Selective recompute (CacheBlend-style) on every engine and attention kind (4-layer models).

The scene: chunk B placed behind a text chunk A (anchor first). Its reused KV is its canonical
KV(B|∅) relocated there; the truth is the model's own prefill of B over A. Recomputing every
token must give the truth; recomputing a share must move toward it, and the tokens the cheap
deviation probe selects must do better than as many random ones (or the rule is no rule).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch

from kamera_agent.backends.base import Backend, DecodeConfig, Decoded, Prefilled, Spent, VisionFeatures
from kamera_agent.backends.tiny_torch import TinyTorchBackend
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.chunks import Chunk
from kamera_agent.core import KVCore, select_tokens
from kamera_agent.errors import CapabilityError, LayoutMismatchError, PositionShapeError, SettingsError
from kamera_agent.models.random_qwen2 import Qwen2Shape, random_qwen2
from kamera_agent.models.tiny_tokenizer import build_byte_tokenizer
from kamera_agent.operator import ChunkKV, relocate, to_position_free
from kamera_agent.store import ChunkStore
from tests.backends.test_transformers_backend import images, text_backend, vl_backend

SDPA_SHAPE = Qwen2Shape(layers=4, hidden=64, heads=4, kv_heads=2, mlp=128, vocab=512)


@cache
def sdpa_qwen2() -> TransformersBackend:
    """Qwen2 on sdpa attention (what a real deployment runs; the tiny factories run eager)."""
    model = random_qwen2(SDPA_SHAPE, seed=3, attention="sdpa")
    return TransformersBackend(model, tokenizer=build_byte_tokenizer(vocab_size=SDPA_SHAPE.vocab))


BACKENDS: dict[str, Callable[[], Backend]] = {
    "qwen2": lambda: text_backend("qwen2", layers=4),
    "qwen2_sdpa": sdpa_qwen2,
    "llama": lambda: text_backend("llama", layers=4),
    "deepseek_v2": lambda: text_backend("deepseek_v2", layers=4),  # MLA: latent and k_pe
    "qwen2_vl": lambda: vl_backend("qwen2_vl", layers=4),  # M-RoPE, an image chunk
    "gemma3": lambda: text_backend("gemma3", layers=4),  # sliding windows of 6, two rotary bases
    "tiny_torch": lambda: TinyTorchBackend(seed=0),
}
LONG_TEXT = "Bob took the box and walked away with it to the garden shed behind the old house."


@dataclass(frozen=True)
class Scene:
    """Chunk B behind anchor + A: its reused (canonical, relocated) and its exact KV."""

    backend: Backend
    chunk: Chunk
    vision: VisionFeatures | None
    context: list[ChunkKV]
    start: int
    reused: ChunkKV
    exact: ChunkKV


def scene(name: str) -> Scene:
    backend = BACKENDS[name]()
    enc = backend.encoder
    anchor = enc.anchor()
    first = enc.text("Alice keeps the key in the blue box under the bed.")
    chunk = enc.image(images(1, size=(112, 112))[0]) if name == "qwen2_vl" else enc.text(LONG_TEXT)
    vision = backend.encode_vision(chunk).features if chunk.has_vision else None
    given = [vision] if vision is not None else []
    anchor_kv = backend.prefill([anchor], [], 0).kv[0]
    first_kv = backend.prefill([first], [anchor_kv], anchor.advance).kv[0]
    start = anchor.advance + first.advance
    exact = backend.prefill([chunk], [anchor_kv, first_kv], start, given).kv[0]
    alone = backend.prefill([chunk], [anchor_kv], anchor.advance, given).kv[0]
    reused = relocate(to_position_free(alone, backend.layout), backend.layout, chunk.positions_at(start))
    return Scene(backend, chunk, vision, [anchor_kv, first_kv], start, reused, exact)


def recompute(s: Scene, indices: torch.Tensor) -> Prefilled:
    return s.backend.recompute(s.chunk, s.reused, indices, s.context, s.start, s.vision)


def flat(kv: ChunkKV) -> torch.Tensor:
    return torch.cat([kv.keys.flatten(), kv.values.flatten()]).double()


def rel_error(got: ChunkKV, want: ChunkKV) -> float:
    return float((flat(got) - flat(want)).norm() / flat(want).norm())


# -- (a) every token recomputed is the prefill ---------------------------------------------------
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_recomputing_every_token_is_the_prefill(name: str) -> None:
    s = scene(name)
    assert s.backend.supports_recompute
    assert rel_error(s.reused, s.exact) > 0.05  # reuse measurably lacks the context: the test can fail
    done = recompute(s, torch.arange(s.chunk.num_tokens))
    assert rel_error(done.kv[0], s.exact) < 1e-5
    assert torch.equal(done.kv[0].positions, s.exact.positions)


# -- (b) only the selected rows change, and they see only what they should ----------------------
@pytest.mark.parametrize("name", ["qwen2", "deepseek_v2", "qwen2_vl", "tiny_torch", "gemma3"])
def test_a_prefix_recomputed_is_exact_and_the_rest_untouched(name: str) -> None:
    """A recomputed prefix sees only fresh rows (its own and earlier ones), so it equals the
    prefill's; a mask that leaked later (reused) slots to it would not."""
    s = scene(name)
    k = s.chunk.num_tokens // 2
    got = recompute(s, torch.arange(k)).kv[0]
    for slot in ("keys", "values"):
        new, old, want = got.slot(slot), s.reused.slot(slot), s.exact.slot(slot)  # type: ignore[arg-type]
        torch.testing.assert_close(new[:, :, :k], want[:, :, :k], rtol=1e-5, atol=1e-5)
        assert torch.equal(new[:, :, k:], old[:, :, k:])
    assert (s.reused.values[-1, :, :k] - s.exact.values[-1, :, :k]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["qwen2", "tiny_torch"])
def test_no_token_recomputed_returns_the_kv_and_costs_nothing(name: str) -> None:
    s = scene(name)
    done = recompute(s, torch.arange(0))
    assert done.kv[0] is s.reused and done.spent == Spent()


@pytest.mark.parametrize("name", ["llama", "qwen2_vl", "tiny_torch", "gemma3"])
def test_a_subset_changes_only_its_rows(name: str) -> None:
    s = scene(name)
    n = s.chunk.num_tokens
    indices = torch.arange(1, n, 3)
    got = recompute(s, indices).kv[0]
    others = torch.ones(n, dtype=torch.bool)
    others[indices] = False
    assert torch.equal(got.keys[:, :, others], s.reused.keys[:, :, others])
    assert torch.equal(got.values[:, :, others], s.reused.values[:, :, others])
    moved = (got.values[-1, :, indices] - s.reused.values[-1, :, indices]).abs().amax(dim=(0, 2))
    assert bool((moved > 1e-4).all())  # every selected row changed at the last layer
    assert got.keys.data_ptr() != s.reused.keys.data_ptr()  # a copy: the reused KV is left as it was


# -- (c) the selection rule ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen2", "deepseek_v2", "tiny_torch", "gemma3"])
def test_error_falls_as_the_fraction_grows_and_deviation_beats_random(name: str) -> None:
    s = scene(name)
    n = s.chunk.num_tokens
    probe = s.backend.deviation(s.chunk, s.reused, s.context, s.start, s.vision)
    errors = [
        rel_error(recompute(s, select_tokens(probe.scores, f)).kv[0], s.exact) for f in (0.05, 0.25, 0.5, 1.0)
    ]
    assert errors[0] < rel_error(s.reused, s.exact)
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 1e-5
    half = math.ceil(n / 2)
    randoms = []
    for seed in range(4):
        pick = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:half].sort().values
        randoms.append(rel_error(recompute(s, pick).kv[0], s.exact))
    assert errors[2] < sum(randoms) / len(randoms), (errors[2], randoms)


@pytest.mark.parametrize("name", ["qwen2", "deepseek_v2", "qwen2_vl", "tiny_torch", "gemma3"])
def test_deviation_is_zero_against_the_exact_kv_and_not_against_reuse(name: str) -> None:
    s = scene(name)
    exact = s.backend.deviation(s.chunk, s.exact, s.context, s.start, s.vision, layers=2)
    reused = s.backend.deviation(s.chunk, s.reused, s.context, s.start, s.vision, layers=2)
    assert exact.layer == reused.layer == 2 and exact.scores.shape == (s.chunk.num_tokens,)
    assert float(exact.scores.max()) < 1e-5
    assert float(reused.scores.mean()) > 1e-2


def test_select_tokens_takes_the_largest_share_sorted() -> None:
    scores = torch.tensor([0.1, 0.9, 0.3, 0.8, 0.2])
    assert select_tokens(scores, 0.4).tolist() == [1, 3]
    assert select_tokens(scores, 0.41).tolist() == [1, 2, 3]  # ceil(2.05)
    assert select_tokens(scores, 1.0).tolist() == [0, 1, 2, 3, 4]
    assert len(select_tokens(torch.rand(100), 0.07)) == 7  # not ceil(7.000000000000001)


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, float("nan"), True, "half"])
def test_select_tokens_refuses_a_fraction_outside_0_1(fraction: Any) -> None:
    with pytest.raises(SettingsError, match=r"\(0, 1\]"):
        select_tokens(torch.rand(10), fraction)


def test_select_tokens_refuses_scores_that_are_not_one_per_token() -> None:
    with pytest.raises(SettingsError, match="1-D"):
        select_tokens(torch.rand(2, 5), 0.5)
    with pytest.raises(SettingsError, match="finite"):
        select_tokens(torch.tensor([0.1, float("nan")]), 0.5)


# -- (d) costs, in the backend and through the core ---------------------------------------------
@pytest.mark.parametrize("name", ["qwen2", "tiny_torch"])
def test_spent_counts_what_ran(name: str) -> None:
    s = scene(name)
    n, layers = s.chunk.num_tokens, s.backend.layout.num_layers
    assert recompute(s, torch.tensor([0, 4, 7])).spent == Spent(forwards=1, tokens_prefilled=3)
    for depth in (1, 3):
        probe = s.backend.deviation(s.chunk, s.reused, s.context, s.start, layers=depth)
        assert probe.spent == Spent(forwards=1, tokens_prefilled=math.ceil(n * depth / layers))


@pytest.mark.parametrize("name", ["qwen2", "qwen2_vl", "tiny_torch"])
def test_the_core_probes_selects_recomputes_and_meters_both(name: str) -> None:
    s = scene(name)
    core = KVCore(s.backend, ChunkStore(fingerprint=s.backend.fingerprint, memory_limit=1 << 28))
    n = s.chunk.num_tokens
    txn = core.txn()
    if s.chunk.has_vision:
        core.vision(s.chunk, txn)  # stored: the recompute below encodes nothing
    before = txn.meter.spent
    blended = core.recompute(s.chunk, s.reused, s.context, s.start, 0.25, txn)
    assert blended.scores is not None
    assert torch.equal(blended.indices, select_tokens(blended.scores, 0.25))
    direct = recompute(s, blended.indices)
    assert torch.equal(blended.kv.keys, direct.kv[0].keys) and torch.equal(
        blended.kv.values, direct.kv[0].values
    )
    probe = Spent(forwards=1, tokens_prefilled=math.ceil(n / s.backend.layout.num_layers))
    assert txn.meter.spent == before + probe + Spent(forwards=1, tokens_prefilled=math.ceil(n / 4))
    everything = core.recompute(s.chunk, s.reused, s.context, s.start, 1.0, txn)
    assert everything.scores is None and rel_error(everything.kv, s.exact) < 1e-5  # no probe to choose


# -- refusals -------------------------------------------------------------------------------------
def test_bad_indices_depth_and_placement_are_refused() -> None:
    s = scene("tiny_torch")
    n = s.chunk.num_tokens
    for bad in (
        torch.tensor([3, 1]),
        torch.tensor([2, 2]),
        torch.tensor([n]),
        torch.tensor([-1]),
        torch.ones(2, 2),
    ):
        with pytest.raises(LayoutMismatchError, match="indices"):
            recompute(s, bad.long())
    with pytest.raises(LayoutMismatchError, match="integer"):
        recompute(s, torch.tensor([0.0, 1.0]))
    for depth in (0, s.backend.layout.num_layers):
        with pytest.raises(SettingsError, match="layers"):
            s.backend.deviation(s.chunk, s.reused, s.context, s.start, layers=depth)
    with pytest.raises(PositionShapeError, match="positions_at"):
        s.backend.recompute(s.chunk, s.reused, torch.arange(2), s.context, s.start + 1)


class _PrefillOnly(Backend):
    """An engine with only the required primitives (prefill delegated)."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.layout, self.fingerprint, self.encoder = (
            inner,
            inner.layout,
            inner.fingerprint,
            inner.encoder,
        )

    device = property(lambda self: self.inner.device)
    dtype = property(lambda self: self.inner.dtype)

    def prefill(
        self, chunks: Sequence[Chunk], context: Sequence[ChunkKV], start: int, *args: Any, **kwargs: Any
    ) -> Prefilled:
        return self.inner.prefill(chunks, context, start, *args, **kwargs)

    def assemble(self, placed: Sequence[ChunkKV], onto: Any | None = None) -> Any:
        return self.inner.assemble(placed, onto)

    def decode(self, cache: Any, query_ids: torch.Tensor, start: int, config: DecodeConfig) -> Decoded:
        return self.inner.decode(cache, query_ids, start, config)


def test_an_engine_without_recompute_says_so_and_how_to_fix() -> None:
    s = scene("tiny_torch")
    plain = _PrefillOnly(s.backend)
    assert not plain.supports_recompute
    with pytest.raises(CapabilityError, match="re-prefill"):
        plain.recompute(s.chunk, s.reused, torch.arange(2), s.context, s.start)
    with pytest.raises(CapabilityError, match="re-prefill"):
        plain.deviation(s.chunk, s.reused, s.context, s.start)


def test_flash_style_attention_offers_no_recompute() -> None:
    """A kernel that takes no custom 4-D mask would let recomputed tokens see later slots."""
    model = random_qwen2(SDPA_SHAPE, seed=3, attention="sdpa")
    model.config._attn_implementation = "flash_attention_2"
    backend = TransformersBackend(model, tokenizer=build_byte_tokenizer(vocab_size=SDPA_SHAPE.vocab))
    assert not backend.supports_recompute
    chunk = backend.encoder.text("some words")
    kv = ChunkKV(torch.zeros(0), torch.zeros(0))
    with pytest.raises(CapabilityError, match="sdpa"):
        backend.recompute(chunk, kv, torch.arange(1), [], 0)
