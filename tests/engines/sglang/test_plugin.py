"""kamera's radix-cache backend against SGLang 0.5.23's real classes (run in .venv-sglang).

No mock of SGLang: its entry-point loader, its registry and ``create_tree_cache`` behind a real
``ServerArgs`` published for a scheduler process, its pools and allocator on CPU, and its own
pad-value scheme for images.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch

from kamera_agent.config import WindowConfig
from kamera_agent.demo.model import DEMO_MODEL_DIR
from kamera_agent.engines.sglang import Segment, segment_key
from kamera_agent.engines.sglang.plugin import BACKEND_NAME, CONFIG_VARIABLE, register, settings
from kamera_agent.engines.sglang.radix import KameraRadixCache
from kamera_agent.engines.sglang.segments import MM_PAD_SHIFT_VALUE
from kamera_agent.errors import UncalibratedWarning
from kamera_agent.fidelity import CALIBRATION_DIR_VARIABLE, Calibration, save_calibration

LAYERS, HEADS, HEAD_DIM, SIZE = 4, 2, 32, 512


def _params(page_size: int = 1):  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    requests = ReqToTokenPool(size=8, max_context_len=1024, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(
        SIZE, page_size, torch.float32, HEADS, HEAD_DIM, LAYERS, "cpu", False, enable_alt_stream=False
    )
    allocator = TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", kv, need_sort=False)
    return CacheInitParams(
        disable=False, req_to_token_pool=requests, token_to_kv_pool_allocator=allocator, page_size=page_size
    )


def test_the_entry_point_registers_the_backend() -> None:
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.plugins import load_plugins

    (point,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == BACKEND_NAME]
    assert point.value == "kamera_agent.engines.sglang.plugin:register"
    load_plugins()  # SGLang's own loader, as every scheduler process runs it
    assert BACKEND_NAME in registered_radix_cache_backends()
    register()  # idempotent: a second load changes nothing
    assert registered_radix_cache_backends().count(BACKEND_NAME) == 1


def test_the_flag_routes_create_tree_cache_to_kamera(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from sglang.srt.mem_cache.registry import create_tree_cache
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    register()
    monkeypatch.setenv(CONFIG_VARIABLE, '{"rank": 16}')
    server_args = ServerArgs(
        model_path=str(DEMO_MODEL_DIR), device="cpu", radix_cache_backend=BACKEND_NAME, dtype="bfloat16"
    )
    publish(server_args, role="scheduler")
    context = _build_context(server_args)
    monkeypatch.setenv(CALIBRATION_DIR_VARIABLE, str(tmp_path))
    with pytest.warns(UncalibratedWarning):  # the checkpoint in bf16: never calibrated
        cache = create_tree_cache(context)
    assert isinstance(cache, KameraRadixCache) and cache.config.rank == 16
    assert cache.synthesis is not None and cache.synthesis.mode == "exact"  # kept states: unbounded
    fingerprint = cache.synthesis.store.fingerprint  # type: ignore[attr-defined]
    save_calibration(Calibration(fingerprint, scale=1.0, budget=0.03), tmp_path)
    cache = create_tree_cache(context)
    # built from the server's own description of the model: no weights loaded
    from transformers import AutoConfig

    demo = AutoConfig.from_pretrained(DEMO_MODEL_DIR).get_text_config()
    assert cache.synthesis is not None and cache.synthesis.mode == "keep"  # survivors keep by default,
    assert cache.synthesis.budget is not None and cache.synthesis.budget.epsilon == 0.03  # within its ε
    assert cache.layout is not None and cache.layout.num_layers == demo.num_hidden_layers
    assert cache.layout.rope.axes is not None  # Qwen2-VL: M-RoPE
    assert cache.rules.image_open is not None and cache.rules.message_starts


def test_the_demo_model_served_in_its_own_dtype_finds_its_shipped_calibration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One fingerprint per model: SGLang's checkpoint in its stored dtype is the weights the demo
    model's calibration was fitted on, so the plugin finds it (no warning, its ε)."""
    import warnings

    from sglang.srt.mem_cache.registry import create_tree_cache
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    from kamera_agent.demo.model import load_demo_model
    from kamera_agent.fidelity import find_calibration
    from kamera_agent.fingerprint import model_fingerprint

    register()
    monkeypatch.setenv(CONFIG_VARIABLE, '{"rank": 16}')
    monkeypatch.setenv(CALIBRATION_DIR_VARIABLE, str(tmp_path))  # nothing of the user's
    server_args = ServerArgs(model_path=str(DEMO_MODEL_DIR), device="cpu", radix_cache_backend=BACKEND_NAME)
    publish(server_args, role="scheduler")
    context = _build_context(server_args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncalibratedWarning)
        cache = create_tree_cache(context)
    shipped = find_calibration(model_fingerprint(load_demo_model()[0]))
    assert shipped is not None
    assert cache.synthesis is not None and cache.synthesis.budget is not None
    assert cache.synthesis.budget.epsilon == shipped.budget


def _build_context(server_args: Any) -> Any:
    """What SGLang's scheduler hands a tree-cache factory, for a scheduler with no worker yet."""
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    return TreeCacheBuildContext(
        server_args=server_args,
        params=_params(),
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )


def test_settings_default_to_the_exact_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_VARIABLE, raising=False)
    assert settings() == WindowConfig.exact()


def test_images_are_found_in_a_key_by_sglangs_own_pad_values() -> None:
    from sglang.srt.managers import schedule_batch

    assert schedule_batch.MM_PAD_SHIFT_VALUE == MM_PAD_SHIFT_VALUE
    first = schedule_batch._compute_pad_values(b"\x01" * 32)
    second = schedule_batch._compute_pad_values(b"\x02" * 32)
    text = [11, 12, 13]
    image_a = [first[i % len(first)] for i in range(6)]
    image_b = [second[i % len(second)] for i in range(9)]
    key = [*text, *image_a, 14, 15, *image_b, 16]
    segments = segment_key(key)
    assert [s.kind for s in segments] == ["text", "image", "text", "image", "text"]
    assert segments[1] == Segment("image", 3, 9, tuple(first))
    assert segments[3].pads == tuple(second) and len(segments[3]) == 9
    assert sum(len(s) for s in segments) == len(key)
    moved = [*image_b, 14, *text, *image_a]  # the same images elsewhere: the same identities
    assert {s.pads for s in segment_key(moved) if s.kind == "image"} == {tuple(first), tuple(second)}


def test_match_prefix_on_real_pools_changes_nothing_when_called_twice() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache = KameraRadixCache(_params())
    allocator = cache.token_to_kv_pool_allocator
    slots = allocator.alloc(6)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5, 6]), value=slots))
    free = allocator.available_size()
    first = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 9])))
    second = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 9])))
    assert first.device_prefix_len == second.device_prefix_len == 4
    assert allocator.available_size() == free and cache.total_size() == 6


def test_the_pool_pairing_follows_sglangs_rule_for_deepseek_without_a_worker() -> None:
    from kamera_agent.engines.sglang.plugin import pool_pairing
    from tests.backends.test_transformers_backend import text_backend

    v3 = text_backend("deepseek_v3", layers=4)
    config = v3.model.config
    assert getattr(config, "rope_interleave", True)  # the released checkpoints' setting
    assert pool_pairing(None, config, v3.layout) == "interleaved"  # SGLang: is_neox_style = not interleave
    config.rope_interleave = False
    try:
        assert pool_pairing(None, config, v3.layout) == "half"
    finally:
        config.rope_interleave = True
    qwen = text_backend("qwen2", layers=4)
    assert pool_pairing(None, qwen.model.config, qwen.layout) is None  # MHA: as the layout pairs it


def test_the_old_plugin_entry_point_still_registers_with_a_warning() -> None:
    """An install made before the move records ``kamera_agent.backends.sglang.plugin:register``."""
    from tests.test_moved import import_in_fresh_interpreter

    done = import_in_fresh_interpreter("kamera_agent.backends.sglang.plugin")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "moved to kamera_agent.engines.sglang.plugin" in done.stdout
