"""Conditioning patches against the model's own conditioned forward.

Setup for every test: anchor prefix P, antecedent A, chunk B, query Q. The model's forward
over ``P A B`` gives ``KV(B|A)`` (conditioned); over ``P B`` it gives ``KV(B|∅)`` (canonical).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from kamera_agent.backends.transformers import kv_layout, read_chunk
from kamera_agent.errors import ForeignPatchError, LayoutMismatchError
from kamera_agent.operator import (
    ChunkKV,
    KVLayout,
    apply_patch,
    form_orbit_patch,
    form_patch,
    load_patch,
    merge_patches,
    save_patch,
    to_position_free,
)
from kamera_agent.operator.patch import deficit
from tests.kv_helpers import cache_from, extend, next_token_kl, prefill, rel_err
from tests.tiny_models import (
    ALL_TEXT_FACTORIES,
    tiny_deepseek_v2,
    tiny_deepseek_v3,
    tiny_glm,
    tiny_llama,
    tiny_qwen2,
)

NP, NA, NB, NQ = 4, 12, 24, 5
FAMILIES = ["llama", "mha_llama", "qwen2", "phi", "glm", "deepseek_v2", "deepseek_v3", "yarn"]
# Random models at the usual init (std 0.02) barely condition one chunk on another; a larger
# init makes the deficit, and so the rank ordering, measurable well above float noise.
CONDITIONING_MODELS = {
    "llama": lambda: tiny_llama(initializer_range=0.1),
    "qwen2": lambda: tiny_qwen2(initializer_range=0.1),
    "glm": lambda: tiny_glm(initializer_range=0.1),
    "deepseek_v2": lambda: tiny_deepseek_v2(initializer_range=0.1),
    "deepseek_v3": lambda: tiny_deepseek_v3(initializer_range=0.1),
}


@cache
def _model(name: str) -> tuple[Any, KVLayout]:
    model = ALL_TEXT_FACTORIES[name]()
    return model, kv_layout(model)


def _tokens(seed: int = 3) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 500, (n,), generator=gen) for n in (NP, NA, NB, NQ))


def _setup(model: Any, layout: KVLayout, offset: int = 0, seed: int = 3) -> dict[str, Any]:
    p, a, b, q = _tokens(seed)
    full = torch.cat([p, a, b, q])
    cache_full, logits = prefill(model, torch.arange(full.numel()) + offset, input_ids=full[None])
    b_pos = torch.arange(NP + NA, NP + NA + NB) + offset
    conditioned = read_chunk(cache_full, layout, NP + NA, NP + NA + NB, b_pos, chunk_key="B")
    antecedent = read_chunk(cache_full, layout, 0, NP + NA, torch.arange(NP + NA) + offset)
    cache_alone, _ = prefill(model, torch.arange(NP + NB), input_ids=torch.cat([p, b])[None])
    alone = read_chunk(cache_alone, layout, NP, NP + NB, torch.arange(NP, NP + NB), chunk_key="B")
    return {
        "canonical": to_position_free(alone, layout),
        "conditioned": conditioned,
        "antecedent": antecedent,
        "b_pos": b_pos,
        "query": q,
        "reference": logits[-1],
    }


def _answer_logits(model: Any, layout: KVLayout, s: dict[str, Any], patched_b: ChunkKV) -> torch.Tensor:
    cache_kv = cache_from(model, [s["antecedent"], patched_b])
    q_pos = torch.arange(NQ) + int(s["b_pos"][-1]) + 1
    return extend(model, cache_kv, s["query"], q_pos)[-1]


@pytest.mark.parametrize("name", FAMILIES)
def test_full_rank_patch_reproduces_conditioned_kv_per_layer(name: str) -> None:
    model, layout = _model(name)
    s = _setup(model, layout)
    patch = form_patch(s["canonical"], s["conditioned"], layout, "full")
    before = s["canonical"].keys.clone(), s["canonical"].values.clone()
    rebuilt = apply_patch(s["canonical"], patch, layout, s["b_pos"])
    assert torch.equal(s["canonical"].keys, before[0]) and torch.equal(s["canonical"].values, before[1])
    for layer in range(layout.num_layers):
        assert rel_err(rebuilt.keys[layer], s["conditioned"].keys[layer]) <= 1e-5
        assert rel_err(rebuilt.values[layer], s["conditioned"].values[layer]) <= 1e-5


@pytest.mark.parametrize("name", FAMILIES)
def test_patch_formed_at_one_offset_serves_another(name: str) -> None:
    model, layout = _model(name)
    here, there = _setup(model, layout, offset=0), _setup(model, layout, offset=1500)
    patch = form_patch(here["canonical"], here["conditioned"], layout, "full")
    moved = apply_patch(here["canonical"], patch, layout, there["b_pos"])
    assert rel_err(moved.slot(layout.rope_slot), there["conditioned"].slot(layout.rope_slot)) <= 2e-5
    assert rel_err(moved.keys, there["conditioned"].keys) <= 2e-5
    assert rel_err(moved.values, there["conditioned"].values) <= 2e-5


@pytest.mark.parametrize("name", sorted(CONDITIONING_MODELS))
def test_next_token_kl_falls_with_rank(name: str) -> None:
    model = CONDITIONING_MODELS[name]()
    layout = kv_layout(model)
    s = _setup(model, layout)

    def kl(rank: int | str) -> float:
        patch = None if rank == 0 else form_patch(s["canonical"], s["conditioned"], layout, rank)  # type: ignore[arg-type]
        return next_token_kl(
            s["reference"],
            _answer_logits(model, layout, s, apply_patch(s["canonical"], patch, layout, s["b_pos"])),
        )

    blind, rank2, rank8, full = kl(0), kl(2), kl(8), kl("full")
    assert blind > 1e-3, "the splice must show a real deficit, or this test could not fail"
    assert blind > rank2 > rank8 > full
    assert full < 1e-9


def test_energy_threshold_picks_the_smallest_rank_reaching_it() -> None:
    model, layout = _model("llama")
    s = _setup(model, layout)
    loose = form_patch(s["canonical"], s["conditioned"], layout, 0.5)
    tight = form_patch(s["canonical"], s["conditioned"], layout, 0.999999)
    for key, rank in loose.ranks.items():
        assert rank <= tight.ranks[key]
    deltas = deficit(s["canonical"], s["conditioned"], layout)
    singular = torch.linalg.svdvals(deltas["values"][1]).double() ** 2
    share = singular.cumsum(0) / singular.sum()
    assert loose.ranks[(1, "values")] == int((share < 0.5).sum()) + 1


def test_randomized_svd_is_near_optimal_like_the_exact_one() -> None:
    """Truncated SVD is the optimal rank-m fit; the randomized one must come within a few %."""
    model, layout = _model("qwen2")
    s = _setup(model, layout)
    deltas = deficit(s["canonical"], s["conditioned"], layout)
    exact = form_patch(s["canonical"], s["conditioned"], layout, 4, method="exact")
    fast = form_patch(s["canonical"], s["conditioned"], layout, 4, method="randomized")
    for slot in ("keys", "values"):
        delta = deltas[slot][1]  # layer 1: layer 0 sees no other chunk, its deficit is zero
        assert delta.norm() > 0
        residual = {}
        for label, patch in (("exact", exact), ("fast", fast)):
            u, v = patch.factors[(1, slot)]
            residual[label] = float((delta - u @ v).norm())
        assert residual["exact"] < float(delta.norm())
        assert residual["fast"] <= 1.05 * residual["exact"]


def test_orbit_patch_serves_both_orderings_of_its_set() -> None:
    model = tiny_llama(initializer_range=0.1)
    layout = kv_layout(model)
    gen = torch.Generator().manual_seed(5)
    p, a1, a2, b, q = (torch.randint(0, 500, (n,), generator=gen) for n in (NP, 8, 8, NB, NQ))
    b_pos = torch.arange(NP + 16, NP + 16 + NB)
    alone_cache, _ = prefill(model, torch.arange(NP + NB), input_ids=torch.cat([p, b])[None])
    canonical = to_position_free(
        read_chunk(alone_cache, layout, NP, NP + NB, torch.arange(NP, NP + NB)), layout
    )
    runs = []
    for first, second in ((a1, a2), (a2, a1)):
        full = torch.cat([p, first, second, b, q])
        kv, logits = prefill(model, torch.arange(full.numel()), input_ids=full[None])
        runs.append((kv, logits[-1]))
    conditioned = [read_chunk(kv, layout, NP + 16, NP + 16 + NB, b_pos) for kv, _ in runs]
    orbit = form_patch(canonical, list(conditioned), layout, "full", state="orbit-a1-a2")
    assert orbit.kind == "orbit"
    q_pos = torch.arange(NQ) + NP + 16 + NB
    for kv, reference in runs:
        ante = read_chunk(kv, layout, 0, NP + 16, torch.arange(NP + 16))
        kls = []
        for patch in (orbit, None):
            b_kv = apply_patch(canonical, patch, layout, b_pos)
            kls.append(next_token_kl(reference, extend(model, cache_from(model, [ante, b_kv]), q, q_pos)[-1]))
        orbit_kl, blind_kl = kls
        assert orbit_kl < 0.5 * blind_kl


def test_deep_half_patch_stores_only_deep_layers_and_fewer_bytes() -> None:
    model = tiny_llama(num_hidden_layers=4)
    layout = kv_layout(model)
    s = _setup(model, layout)
    all_layers = form_patch(s["canonical"], s["conditioned"], layout, 4)
    deep = form_patch(s["canonical"], s["conditioned"], layout, 4, layers="deep_half")
    assert {layer for layer, _ in deep.factors} == {2, 3}
    assert deep.nbytes * 2 == all_layers.nbytes
    n, features = NB, layout.keys_shape[0] * layout.keys_shape[1]
    assert all_layers.nbytes == 4 * 2 * 4 * (n + features) * 4  # layers · slots · rank · (n + F) · fp32
    with pytest.raises(LayoutMismatchError, match="within"):
        form_patch(s["canonical"], s["conditioned"], layout, 4, layers=[7])


def test_patch_round_trips_through_safetensors(tmp_path: Path) -> None:
    model, layout = _model("deepseek_v2")
    s = _setup(model, layout)
    patch = form_patch(s["canonical"], s["conditioned"], layout, 8, state="A")
    written = save_patch(patch, tmp_path / "p.safetensors")
    loaded = load_patch(tmp_path / "p.safetensors")
    assert written == patch.nbytes == loaded.nbytes
    assert (loaded.chunk_key, loaded.state, loaded.num_tokens) == ("B", "A", NB)
    for key, (u, v) in patch.factors.items():
        assert torch.equal(loaded.factors[key][0], u) and torch.equal(loaded.factors[key][1], v)


def test_foreign_patches_are_refused_with_a_fix() -> None:
    model, layout = _model("llama")
    s = _setup(model, layout)
    patch = form_patch(s["canonical"], s["conditioned"], layout, 4)
    other_chunk = replace(s["canonical"], chunk_key="C")
    with pytest.raises(ForeignPatchError, match="chunk mismatch"):
        apply_patch(other_chunk, patch, layout, s["b_pos"])
    with pytest.raises(ForeignPatchError, match="model mismatch"):
        apply_patch(
            replace(s["canonical"], model_fingerprint="m2"),
            replace(patch, model_fingerprint="m1"),
            layout,
            s["b_pos"],
        )
    shorter = ChunkKV(s["canonical"].keys[:, :, :10], s["canonical"].values[:, :, :10], None, "B")
    with pytest.raises(ForeignPatchError, match="24-token chunk"):
        apply_patch(shorter, patch, layout, s["b_pos"][:10])
    mla_model, mla_layout = _model("deepseek_v3")
    mla = _setup(mla_model, mla_layout)
    with pytest.raises(LayoutMismatchError, match="another model"):
        apply_patch(mla["canonical"], patch, mla_layout, mla["b_pos"])
    with pytest.raises(LayoutMismatchError, match="another model"):
        form_patch(s["canonical"], mla["conditioned"], layout, 4)
    with pytest.raises(ValueError, match="energy"):
        form_patch(s["canonical"], s["conditioned"], layout, 1.5)


def test_dynamic_and_longrope_are_refused() -> None:
    from kamera_agent.errors import LengthDependentRopeError
    from tests.tiny_models import tiny_llama_dynamic

    with pytest.raises(LengthDependentRopeError, match="re-prefill"):
        kv_layout(tiny_llama_dynamic())


def test_unknown_family_is_named() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from kamera_agent.errors import UnsupportedModelError

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match=r"gpt2.*supported"):
        kv_layout(model)


def test_merged_patches_equal_the_patch_of_the_mean_deficit() -> None:
    """Orbit by merging stored factors == orbit formed from the deficits themselves."""
    model = tiny_llama(initializer_range=0.1)
    layout = kv_layout(model)
    runs = [_setup(model, layout, seed=seed) for seed in (3, 3)]
    # Same chunk B (seed 3 fixes its tokens), two antecedents: re-draw A for the second run.
    gen = torch.Generator().manual_seed(8)
    p, _, b, _ = _tokens(3)
    other_a = torch.randint(0, 500, (NA,), generator=gen)
    full = torch.cat([p, other_a, b])
    kv, _ = prefill(model, torch.arange(full.numel()), input_ids=full[None])
    second = read_chunk(kv, layout, NP + NA, NP + NA + NB, torch.arange(NP + NA, NP + NA + NB), chunk_key="B")
    canonical, first = runs[0]["canonical"], runs[0]["conditioned"]
    exact = [form_patch(canonical, c, layout, "full") for c in (first, second)]
    merged = merge_patches(exact, "full")
    direct = form_patch(canonical, [first, second], layout, "full")
    with pytest.warns(DeprecationWarning, match="form_patch"):
        old = form_orbit_patch(canonical, [first, second], layout, "full")
    assert old.kind == direct.kind == "orbit"
    pos = runs[0]["b_pos"]
    a = apply_patch(canonical, merged, layout, pos)
    d = apply_patch(canonical, direct, layout, pos)
    assert rel_err(a.keys, d.keys) < 1e-5 and rel_err(a.values, d.values) < 1e-5
    low = merge_patches(exact, 4)
    assert max(low.ranks.values()) <= 4
    with pytest.raises(ForeignPatchError, match="different chunks"):
        merge_patches([exact[0], replace(exact[1], chunk_key="C")], 4)


def test_longrope_is_refused_too() -> None:
    from kamera_agent.errors import LengthDependentRopeError

    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 4096,
    }
    with pytest.raises(LengthDependentRopeError, match="longrope"):
        kv_layout(tiny_llama(rope_parameters=rope))
