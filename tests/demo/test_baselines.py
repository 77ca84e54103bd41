"""The token-recompute baselines run at their best and bracket what they can reach.

Each sweep arm at a 100 % budget must answer as re-prefill does (every token gets its in-context
KV) and at 0 % exactly as blind reuse does: a baseline that cannot reach either end is rigged.
"""

from __future__ import annotations

import pytest
import torch

from kamera_agent.backends import TransformersBackend
from kamera_agent.bench.fidelity import arm_spends
from kamera_agent.demo.evaluate import RECOMPUTE_ARMS, SHARES, Recompute, _deviation, evaluate
from kamera_agent.demo.model import load_demo_model
from kamera_agent.demo.task import make_items
from kamera_agent.operator.layout import ChunkKV

FULL = ("cacheblend-chunk-100", "cacheblend-global-100", "epic-128")
NONE = ("cacheblend-chunk-0", "cacheblend-global-0", "epic-0")


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    model, tokenizer, image_processor = load_demo_model()
    return TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)


def test_every_sweep_reaches_re_prefill_at_full_budget_and_blind_reuse_at_none(
    backend: TransformersBackend,
) -> None:
    items = make_items(6, 424_242, kind="colour")
    result = evaluate(backend, items, arms=("blind", *FULL, *NONE, "cacheblend-global-30"))
    blind = result.result("blind")
    assert blind.mean_kl > 1.0  # the demo task's binding deficit: blind reuse is far off
    for arm in FULL:  # epic-128 covers every chunk of the demo (pages 100 tokens, frames 6)
        assert result.result(arm).mean_kl < 1e-9, arm  # the re-prefill's own KV: float rounding only
        assert result.result(arm).top1_agreement == 1.0, arm
    for arm in NONE:
        assert result.result(arm).kl_sum == pytest.approx(blind.kl_sum, rel=1e-6), arm
    middle = result.result("cacheblend-global-30").mean_kl  # in between, strictly
    assert 1e-4 < middle < blind.mean_kl


def test_budgets_count_what_each_arm_recomputes() -> None:
    tokens, features = [6, 6, 20, 20], (64, 64)
    arms = [f"cacheblend-chunk-{p}" for p in SHARES] + ["epic-4", "epic-32", "cacheblend-bytes-16"]
    spends = arm_spends(arms, tokens, features)
    assert spends["cacheblend-chunk-0"].recomputed == 0.0
    assert spends["cacheblend-chunk-100"].recomputed == 1.0 == spends["epic-32"].recomputed
    assert spends["epic-4"].recomputed == (4 + 4 + 4 + 4) / 52
    # rank 16 stores 16·(n + F) numbers where a token's KV is F: ceil(16·(n + 64) / 64) tokens
    assert (
        Recompute("deviation", rank=16).count(20, 64) == 20
        and Recompute("deviation", rank=2).count(20, 64) == 3
    )
    assert RECOMPUTE_ARMS["cacheblend-global-15"].scope == "global"


def test_cacheblend_selects_the_tokens_whose_kv_deviates_in_any_layer() -> None:
    # a model that binds above its first layers: the deviating tokens differ only in layer 4 of 6,
    # where a layer-1 score (CacheBlend's first filter) would see nothing and choose at random
    blind = ChunkKV(torch.randn(6, 2, 10, 8), torch.randn(6, 2, 10, 8))
    keys, values = blind.keys.clone(), blind.values.clone()
    keys[4, :, [2, 7]] += 1.0
    values[4, :, [2, 7]] -= 1.0
    keys[1] += 1e-3 * torch.randn_like(keys[1])  # layer-1 noise that must not decide
    conditioned = ChunkKV(keys, values)
    scores = _deviation(blind, conditioned)
    assert set(scores.topk(2).indices.tolist()) == {2, 7}
