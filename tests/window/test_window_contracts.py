"""The window's contracts, each a regression test: reuse across windows, refs across forks, dry
runs, settings that apply or say where, transactions over the store, and bounded memory.

Every test runs on both backends (transformers and the plain-torch one) with 4-layer models.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kamera_agent.backends.base import Backend, DecodeConfig
from kamera_agent.config import WindowConfig
from kamera_agent.errors import (
    ChunkInWindowError,
    ChunkLostError,
    SettingsError,
    StoreLimitError,
    UnknownChunkError,
)
from kamera_agent.store import ChunkStore
from kamera_agent.testing import CountingBackend
from kamera_agent.window import KameraWindow
from tests.backends.test_transformers_backend import images
from tests.window.backends import backend_named
from tests.window.helpers import chunk_errors, reprefill
from tests.window.oracle import StateOracle

TEXT_BACKENDS = ["qwen2", "tiny_torch"]
IMAGE_BACKENDS = ["qwen2_vl", "tiny_torch"]
A, B, C, D = "alpha one two", "beta three four", "gamma five six", "delta seven eight"


def store_for(backend: Backend, budget: int = 1 << 26) -> ChunkStore:
    return ChunkStore(fingerprint=backend.fingerprint, memory_limit=budget)


def logit_error(window: KameraWindow, query: str = "What is it?") -> float:
    truth = reprefill(window, query).logits
    return float((window.ask(query, decode=DecodeConfig(max_new_tokens=1)).first_logits - truth).abs().max())


# -- reuse across windows: the repro ----------------------------------------------------
@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_a_patch_formed_over_a_survivor_is_never_served_to_fresh_antecedents(name: str) -> None:
    """Window 1 slides A out; C still encodes A, so D's patch is formed over a C that encodes A.
    A fresh window over the same store pushes B, C, D under the exact settings: D must not be
    served that patch (it was 0.31 off in logits when patches were filed by content keys)."""
    backend = backend_named(name)
    store = store_for(backend)
    first = KameraWindow(backend, store=store, config=WindowConfig(drift_budget=None, rank="full"))
    for text in (A, B, C):
        first.push(text)
    first.slide()
    first.push(D)
    fresh = KameraWindow(backend, store=store, config=WindowConfig.exact())
    refs = [fresh.push(text) for text in (B, C, D)]
    served, formed = fresh.state_of(refs[-1]), first.state_of(first.refs[-1])
    assert served.exact and not formed.exact and served != formed  # the survivor's state is chained in
    assert logit_error(fresh) < 1e-4
    own = KameraWindow(backend, config=WindowConfig.exact())  # the control: a store of its own
    for text in (B, C, D):
        own.push(text)
    assert logit_error(own) < 1e-4


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_a_second_window_finds_the_first_windows_patches_where_they_are_exact(name: str) -> None:
    backend = backend_named(name)
    store = store_for(backend)
    first = KameraWindow(backend, store=store, config=WindowConfig.exact())
    for text in (A, B, C):
        first.push(text)
    second = KameraWindow(backend, store=store, config=WindowConfig.exact())
    for text in (A, B, C):
        second.push(text)
    pushes = second.stats.by_op["push"]
    assert (pushes.forwards, pushes.patches_applied, pushes.patches_formed) == (0, 2, 0)
    assert max(chunk_errors(second).values()) <= 2e-5


# -- refs across forks ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_refs_minted_after_a_fork_belong_to_their_branch_only(name: str) -> None:
    window = KameraWindow(backend_named(name), config=WindowConfig(drift_budget=None, rank="full"))
    shared = window.push(A)
    branch = window.fork()
    mine, theirs = branch.push(B), window.push(C)
    assert mine != theirs  # they used to alias: same id in one shared id space
    with pytest.raises(UnknownChunkError, match="another window's or branch's"):
        window.evict(mine)
    with pytest.raises(UnknownChunkError, match="another window's or branch's"):
        branch.evict(theirs)
    assert window.refs == [shared, theirs] and branch.refs == [shared, mine]
    branch.evict(shared)  # refs minted before the fork work in both
    assert window.refs == [shared, theirs]


# -- plan() is a dry run for every op and policy ---------------------------------------------------
POLICIES: list[dict[str, Any]] = [
    {},
    {"eviction": "lru", "survivors": "removal", "recall_context": "current"},
    {"eviction": "disposable", "patch_mode": "lazy", "cascade": "keep", "reorder": "keep"},
    {"eviction": "disposable", "orbit": False, "reorder": "revert"},
]


@pytest.mark.parametrize("policy", range(len(POLICIES)))
@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_plan_runs_nothing_and_changes_nothing_for_every_op_and_policy(name: str, policy: int) -> None:
    backend = CountingBackend(backend_named(name))
    config = WindowConfig(drift_budget=None, rank=4, capacity_chunks=3, max_new_tokens=1, **POLICIES[policy])
    window = KameraWindow(backend, config=config)
    refs = [window.push(text) for text in (A, B, C, D)]  # the fourth push evicts one (FIFO: no query yet)
    window.ask("What is it?")  # probe-driven eviction now has a query to probe against
    before = (backend.total(), window.stats, window.store.stats(), window.store.keys(), window.refs)
    plans = [
        window.plan("push", "one more"),  # over capacity: under "disposable" this lists probes
        window.plan("reorder", list(reversed(window.refs))),
        window.plan("slide", 1),
        window.plan("evict", window.refs[0]),
        window.plan("recall", refs[0], at=0),
    ]
    assert (backend.total(), window.stats, window.store.stats(), window.store.keys(), window.refs) == before
    probing = config.eviction == "disposable"
    assert plans[0].count("probe") == plans[-1].count("probe") == (3 if probing else 0)


def test_probe_driven_eviction_probes_only_when_a_push_overflows() -> None:
    backend = CountingBackend(backend_named("tiny_torch"))
    window = KameraWindow(
        backend, config=WindowConfig(drift_budget=None, rank=4, capacity_chunks=3, eviction="disposable")
    )
    window.push(A)
    window.ask("What is it?", decode=DecodeConfig(max_new_tokens=1))
    window.push(B)  # below capacity: no probe
    assert window.stats.last.probes == 0 and window.stats.last.forwards == 1  # new content: one forward
    window.push(C)
    window.ask("What is it?", decode=DecodeConfig(max_new_tokens=1))
    plan = window.plan("push", D)
    window.push(D)  # overflows: every in-window chunk is probed once, then one leaves
    assert window.stats.last.probes == 3 == plan.count("probe")
    assert len(window) == 3 and len(window.evicted) == 1


# -- settings apply, or say where to set them ----------------------------------------------------
def test_store_settings_apply_to_a_backend_and_conflicts_are_named(tmp_path: Any) -> None:
    backend = backend_named("tiny_torch")
    config = WindowConfig(drift_budget=None, memory_limit=12345, disk_dir=tmp_path, disk_limit=1 << 20)
    window = KameraWindow(backend, config=config)
    stats = window.store.stats()
    assert (stats.memory_limit, stats.disk_limit, window.store.disk_dir) == (12345, 1 << 20, tmp_path)
    with pytest.raises(SettingsError, match=r"memory_limit.*store= was passed"):
        KameraWindow(
            backend, config=WindowConfig(drift_budget=None, memory_limit=1 << 20), store=store_for(backend)
        )


def test_device_and_dtype_for_a_backend_built_elsewhere_are_refused_with_where_to_set_them() -> None:
    backend = backend_named("tiny_torch")
    with pytest.raises(SettingsError, match=r"dtype='bfloat16'.*move or cast the model"):
        KameraWindow(backend, config=WindowConfig(drift_budget=None, dtype="bfloat16"))
    with pytest.raises(SettingsError, match="device='meta'"):
        KameraWindow(backend, config=WindowConfig(drift_budget=None, device="meta"))
    KameraWindow(
        backend, config=WindowConfig(drift_budget=None, device="cpu", dtype="float32")
    )  # where it runs: fine


# -- transactions cover the store -------------------------------------------------------------------
@pytest.mark.parametrize("name", IMAGE_BACKENDS)
def test_an_op_that_fails_mid_way_leaves_window_and_store_as_they_were(name: str) -> None:
    backend = CountingBackend(backend_named(name))
    store = store_for(backend)
    window = KameraWindow(backend, config=WindowConfig(drift_budget=None, rank="full"), store=store)
    window.push(A)
    window.push(B)
    before = (window.refs, window.stats, store.keys(), store.stats().puts)
    backend.fail_prefill_at = backend.calls["prefill"] + 1  # its vision output is staged, its forward fails
    with pytest.raises(RuntimeError, match="mid-op"):
        window.push(images(1, seed=53)[0])
    assert backend.calls["encode_vision"] == 1
    assert (window.refs, window.stats, store.keys(), store.stats().puts) == before
    backend.fail_prefill_at = None
    window.push(C)
    window.push(images(1, seed=53)[0])
    assert max(chunk_errors(window).values()) <= 2e-5


def test_a_canonical_no_budget_can_hold_fails_before_anything_runs() -> None:
    backend = CountingBackend(backend_named("tiny_torch"))
    window = KameraWindow(backend, config=WindowConfig(drift_budget=None, memory_limit=256))
    with pytest.raises(StoreLimitError, match="raise memory_limit"):
        window.push(A)
    assert backend.total() == 0 and window.refs == [] and window.store.keys() == []


def test_a_patch_larger_than_the_budget_is_used_uncached_and_counted() -> None:
    backend = backend_named("tiny_torch")
    texts = (A, B, C)
    sizes = [backend.encoder.text(text).num_tokens for text in texts]
    canonical = max(sizes) * backend.layout.bytes_per_token(backend.dtype)
    # Room for a canonical, not for a near-full-rank patch of the same chunk ([n, m] + [m, F] factors).
    rank = max(sizes) - 1
    config = WindowConfig(drift_budget=None, rank=rank, orbit=False, memory_limit=int(canonical * 1.05))
    window = KameraWindow(backend, config=config)
    longest_text = texts[sizes.index(max(sizes))]
    first, second = (window.push(text) for text in texts if text != longest_text)
    longest = window.push(longest_text)
    a, b, c = first, second, longest
    # A rank-m patch needs the canonical: a branch (same store) that starts with the chunk forms
    # and stores it (the last entry the budget holds), so new antecedents then give a rank-m
    # patch against it.
    branch = window.fork()
    branch.slide(len(branch))
    branch.push(longest_text)
    window.reorder([second, first, longest])
    assert window.stats.last.uncached >= 1 and window.state_of(longest).rank == rank
    assert window.patch_of(longest) is not None  # held by the window: it serves the next answers
    oracle = StateOracle(backend)
    for ref in (a, b, c):
        oracle.know(window.chunk(ref))
    assert max(error for error, _ in oracle.errors(window).values()) <= 1e-4


# -- bounded memory ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", IMAGE_BACKENDS)
def test_an_evicted_image_releases_its_pixels_and_recalls_without_them(name: str) -> None:
    backend = CountingBackend(backend_named(name))
    window = KameraWindow(backend, config=WindowConfig(drift_budget=None, rank="full"))
    frame = window.push(images(1, seed=51)[0])
    window.push("the frame above")
    window.evict(frame)
    assert not window.chunk(frame).has_pixels and window.chunk(frame).has_vision
    vision = backend.calls["encode_vision"]
    window.recall(frame, at=0)
    assert backend.calls["encode_vision"] == vision and window.stats.last.vision_encodes == 0


def test_an_image_whose_pixels_kv_and_vision_output_are_all_gone_is_refused_by_name() -> None:
    backend = backend_named("tiny_torch")
    store = store_for(backend)
    window = KameraWindow(backend, config=WindowConfig(drift_budget=None, rank="full"), store=store)
    frame = window.push(images(1, seed=52)[0])
    window.push("text after it")
    window.evict(frame)
    for key in list(store.keys()):  # the budget dropped everything (a memory-only store under pressure)
        store._memory.pop(key)
    before = (window.refs, sorted(window.evicted))
    with pytest.raises(ChunkLostError, match="push the content again"):
        window.recall(frame)
    assert (window.refs, sorted(window.evicted)) == before


@pytest.mark.parametrize("name", TEXT_BACKENDS)
def test_forget_and_max_evicted_bound_what_a_window_remembers(name: str) -> None:
    window = KameraWindow(backend_named(name), config=WindowConfig(drift_budget=None, rank=4, max_evicted=2))
    refs = [window.push(text) for text in (A, B, C, D, "epsilon nine ten")]
    with pytest.raises(ChunkInWindowError, match="evict it before forgetting"):
        window.forget(refs[0])
    window.slide(3)  # three evicted, two kept: the oldest evicted is forgotten
    assert sorted(window.evicted) == refs[1:3] and window.stats.last.forgotten == 1
    with pytest.raises(UnknownChunkError, match="forgotten"):
        window.recall(refs[0])
    window.forget(refs[1])
    assert window.evicted == [refs[2]] and window.stats.total.forgotten == 2
    survivor = window.state_of(refs[4])  # kept its KV: it still says what it encodes, forgotten chunks too
    assert refs[0].key in [antecedent.chunk_key for antecedent in survivor.context.states()]
    window.recall(refs[2])
    assert torch.isfinite(window.chunk_kv(refs[2]).keys).all()
