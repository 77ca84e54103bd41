"""`KameraRadixCache` through SGLang 0.5.23's real admission path (run in .venv-sglang).

Requests go through the harness: real ``Req``s, ``match_prefix`` and ``init_load_back`` called by
SGLang's own ``PrefillAdder``, slots placed by ``ScheduleBatch.prepare_for_extend``, KV captured
in the cache's ``checkpoint`` as SGLang's release path calls it. The simulated forward writes the
transformers model's own KV for the request's tokens at SGLang's positions, so the KV a load
writes can be held to what the model computes: the same tokens in the state the chunk is served
in, at the request's positions (a moved chunk's KV is the model's forward of the chunks it
absorbed, shifted by the move: attention sees relative positions only).
"""

from __future__ import annotations

import functools
import logging
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.config import WindowConfig
from kamera_agent.engines.sglang.pool import SGLangSlots
from kamera_agent.engines.sglang.radix import KameraRadixCache
from kamera_agent.engines.sglang.segments import ChunkRules
from kamera_agent.errors import UncalibratedWarning
from kamera_agent.fidelity import CALIBRATION_DIR_VARIABLE, Calibration, save_calibration
from kamera_agent.operator.layout import ChunkKV, to_position_free
from kamera_agent.store import ChunkStore
from tests.backends.test_transformers_backend import images, text_backend, vl_backend
from tests.engines.sglang.harness import Admission, stamp_kv

EXACT = 2e-5

UNBOUNDED = WindowConfig(drift_budget=None)
"""The defaults with kept states unbounded: these random models have no drift calibration (the
default budget would serve them exactly); what the budget allows is tested in
tests/engines/test_synthesis.py."""


@dataclass
class Prompt:
    """A request built from kamera chunks: SGLang's token ids (an image's placeholders replaced by
    its content-derived pad values, as SGLang's processor does), its positions, the model's KV."""

    tokens: list[int]
    positions: torch.Tensor  # [n], or [3, n] for M-RoPE (what SGLang precomputes per request)
    kv: ChunkKV  # [L, H, n, D] at ``positions``
    bounds: list[tuple[int, int]]


def _pads(chunk: Chunk) -> list[int]:
    from sglang.srt.managers import schedule_batch

    assert chunk.vision_key is not None
    values = schedule_batch._compute_pad_values(bytes.fromhex(chunk.vision_key[:64]))
    return [values[i % len(values)] for i in range(int(chunk.mm_token_type_ids.sum()))]


def _prompt(backend: Any, chunks: list[Chunk], shift: int = 0) -> Prompt:
    anchor = backend.anchor
    kvs = [backend.prefill([anchor], [], shift).kv[0], *backend.prefill_sequence(chunks, shift=shift)]
    tokens: list[int] = []
    bounds = []
    for chunk in [anchor, *chunks]:
        ids = chunk.input_ids.tolist()
        if chunk.has_vision:
            pads = iter(_pads(chunk))
            ids = [next(pads) if m else t for t, m in zip(ids, chunk.mm_token_type_ids.tolist(), strict=True)]
        bounds.append((len(tokens), len(tokens) + len(ids)))
        tokens += ids
    keys = torch.cat([kv.keys for kv in kvs], dim=2)
    values = torch.cat([kv.values for kv in kvs], dim=2)
    positions = torch.cat([kv.positions for kv in kvs if kv.positions is not None], dim=-1)
    return Prompt(tokens, positions, ChunkKV(keys, values, positions), bounds)


class Model:
    """The harness's forward: each request's slots get the model's own KV for its prompt."""

    def __init__(self, backend: Any, salt: str | None = None) -> None:
        self.backend, self.prompts = backend, {}
        self.salt = salt
        """Every request's ``cache_salt``: kept states are served only under one."""

    def request(self, harness: Admission, prompt: Prompt, rid: str) -> Any:
        from sglang.srt.managers.schedule_batch import MultimodalInputs

        req = harness.request(prompt.tokens, rid=rid)
        req.cache_salt = self.salt
        if prompt.positions.ndim == 2:  # M-RoPE: SGLang's processor precomputes the prompt's positions
            req.multimodal_inputs = MultimodalInputs(mm_items=[])
            req.multimodal_inputs.mrope_positions = prompt.positions.clone()
        self.prompts[rid] = prompt
        return req

    def __call__(self, req: Any, slots: torch.Tensor, start: int, end: int) -> None:
        prompt = self.prompts[req.rid]
        end = min(end, len(prompt.tokens))  # an output token's KV is not checked
        if end <= start:
            return
        part = _part(prompt.kv, start, end)
        pool = SGLangSlots(self.harness.kv_pool, self.backend.layout)
        pool.write(to_position_free(part, self.backend.layout), part.positions, slots[: end - start])

    harness: Admission


def _part(kv: ChunkKV, start: int, end: int) -> ChunkKV:
    assert kv.positions is not None
    return replace(
        kv,
        keys=kv.keys[:, :, start:end],
        values=kv.values[:, :, start:end],
        positions=kv.positions[..., start:end],
    )


def _setup(
    backend: Any,
    page_size: int,
    config: WindowConfig,
    size: int = 2048,
    store_budget: int = 1 << 28,
    chunked_prefill_size: int | None = None,
    store: ChunkStore | None = None,
) -> tuple[Admission, Model]:
    layout = backend.layout
    store = store or ChunkStore(fingerprint=backend.fingerprint, memory_limit=store_budget)
    tokenizer = backend.encoder.tokenizer
    config_of_model = backend.model.config
    rules = ChunkRules.for_model(config_of_model, tokenizer)
    model = Model(backend, salt="agent-1" if config.survivors == "keep" else None)

    def factory(params: Any) -> KameraRadixCache:
        return KameraRadixCache(params, config, store=store, layout=layout, rules=rules)

    (heads, head_dim), _ = layout.keys_shape, layout.values_shape
    harness = Admission(
        factory,
        page_size=page_size,
        size=size,
        layers=layout.num_layers,
        heads=heads,
        head_dim=head_dim,
        on_extend=model,
        kv_pool=_mla_pool(layout) if layout.kind == "mla" else None,
        chunked_prefill_size=chunked_prefill_size,
    )
    model.harness = harness
    return harness, model


def _mla_pool(layout: Any) -> Any:
    def build(size: int, page_size: int) -> Any:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

        return MLATokenToKVPool(
            size,
            page_size,
            torch.float32,
            layout.keys_shape[1],
            layout.values_shape[1],
            layout.num_layers,
            "cpu",
            False,
        )

    return build


def _pool_kv(harness: Admission, backend: Any, slots: torch.Tensor, positions: torch.Tensor) -> ChunkKV:
    return SGLangSlots(harness.kv_pool, backend.layout).read(slots, positions)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _run(harness: Admission, model: Model, prompt: Prompt, rid: str) -> Any:
    req = model.request(harness, prompt, rid)
    assert harness.admit([req]) == [req]
    return req


def move_a_chunk(harness: Admission, model: Model) -> tuple[Prompt, Any]:
    """Three requests: a note captured behind one prefix, another prefix, then the note moved
    behind that one (where the store holds it only in its kept state); the last prompt and
    request."""
    backend = model.backend
    moved = _text(backend, "the blue kite was stuck in the oak tree")
    later = _text(backend, "a much longer note about the morning, the walk, the dog and the rain")
    _run(harness, model, _prompt(backend, [_text(backend, "one"), moved, _text(backend, "q1")]), "first")
    harness.prefill()
    _run(harness, model, _prompt(backend, [later, _text(backend, "q0")]), "other")
    harness.prefill()
    now = _prompt(backend, [later, moved, _text(backend, "where is the kite?")])
    return now, _run(harness, model, now, "moved")


def _backend(family: str) -> Any:
    if family == "qwen2_vl":
        return vl_backend("qwen2_vl", layers=4)
    return text_backend(family, layers=4)


def _text(backend: Any, words: str) -> Chunk:
    return backend.encoder.text(f"<|im_start|>user\n{words}<|im_end|>\n")


def _image(backend: Any, seed: int) -> Chunk:
    return backend.encoder.image(images(1, seed, size=(112, 112))[0])


FAMILIES = ["qwen2", "qwen2_vl", "deepseek_v2"]


@pytest.mark.parametrize("chunked", [None, 32], ids=["whole", "chunked"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("family", FAMILIES)
def test_exact_loads_the_models_own_kv_after_the_tree_lost_it(
    family: str, page_size: int, chunked: int | None
) -> None:
    """With chunked prefill (SGLang's default) the first prompt is prefilled and captured over
    several passes, the second's remainder after the load computed over several."""
    backend = _backend(family)
    harness, model = _setup(backend, page_size, WindowConfig.exact(), chunked_prefill_size=chunked)
    cache = harness.tree_cache
    middle = (
        _image(backend, 1)
        if family == "qwen2_vl"
        else _text(backend, "a red ball rolled under the old table")
    )
    chunks = [_text(backend, "notes from the first morning of the trip"), middle, _text(backend, "then rain")]
    first = _prompt(backend, [*chunks, _text(backend, "what rolled?")])
    _run(harness, model, first, "first")
    harness.drain()
    assert cache.stats.chunks_captured >= 4
    harness.evict_all()  # the tree lost every slot: only the store still holds the chunks
    assert cache.total_size() == 0

    second = _prompt(backend, [*chunks, _text(backend, "what fell?")])
    req = _run(harness, model, second, "second")
    hit = second.bounds[3][1] // page_size * page_size  # every chunk but the question, page-aligned
    assert req.prefix_len == hit and cache.stats.tokens_loaded == hit
    slots = harness.row(req, hit)
    got = _pool_kv(harness, backend, slots, second.positions[..., :hit])
    want = to_position_free(_part(second.kv, 0, hit), backend.layout)
    assert _rel(got.keys, want.keys) < EXACT and _rel(got.values, want.values) < EXACT
    harness.drain()
    harness.evict_all()
    assert harness.free_slots() == harness.capacity
    harness.check()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_moved_chunk_is_served_from_its_capture_at_its_new_positions(family: str, page_size: int) -> None:
    backend = _backend(family)
    harness, model = _setup(backend, page_size, UNBOUNDED)  # survivors keep: kept states served
    cache = harness.tree_cache
    before = _text(backend, "one")
    moved = (
        _image(backend, 2)
        if family == "qwen2_vl"
        else _text(backend, "the blue kite was stuck in the oak tree")
    )
    later = _text(backend, "a much longer note about the morning, the walk, the dog and the rain")
    _run(harness, model, _prompt(backend, [before, moved, _text(backend, "q1")]), "first")
    harness.prefill()
    _run(harness, model, _prompt(backend, [later, _text(backend, "q0")]), "other")
    harness.prefill()

    now = _prompt(backend, [later, moved, _text(backend, "where is the kite?")])
    req = _run(harness, model, now, "moved")
    start, end = now.bounds[2]
    assert req.prefix_len == end // page_size * page_size > start  # the moved chunk was loaded
    assert cache.stats.loads == 1
    old = _prompt(backend, [before, moved])
    shift = int(now.positions[..., start].max() - old.positions[..., old.bounds[2][0]].max())
    assert shift > 0
    truth = _prompt(backend, [before, moved], shift=shift)  # what the kept chunk encodes, moved
    device = req.prefix_len - cache.stats.tokens_loaded  # SGLang's own hit (it may end inside the chunk)
    assert device <= start + 8  # at most the message header the last request shared
    lo = max(start, device)
    a, n = truth.bounds[2][0] + lo - start, req.prefix_len - lo  # the loaded part of the moved chunk
    positions = now.positions[..., lo : req.prefix_len]
    assert torch.equal(truth.positions[..., a : a + n], positions)
    got = _pool_kv(harness, backend, harness.row(req)[lo : req.prefix_len], positions)
    want = to_position_free(_part(truth.kv, a, a + n), backend.layout)
    assert _rel(got.keys, want.keys) < EXACT and _rel(got.values, want.values) < EXACT
    if device > start:  # the header SGLang matched is its own forward here: the chunk is spliced
        head = _pool_kv(harness, backend, harness.row(req)[start:device], now.positions[..., start:device])
        exact = to_position_free(_part(now.kv, start, device), backend.layout)
        assert _rel(head.keys, exact.keys) < EXACT
    harness.drain()
    harness.evict_all()
    assert harness.free_slots() == harness.capacity
    harness.check()


def test_a_tenant_is_never_served_another_tenants_chunks() -> None:
    backend = _backend("qwen2")
    harness, model = _setup(backend, 1, WindowConfig.exact())
    cache = harness.tree_cache
    chunks = [_text(backend, "the private notes of tenant a"), _text(backend, "more of them")]
    prompt = _prompt(backend, [*chunks, _text(backend, "q")])
    first = model.request(harness, prompt, "a1")
    first.extra_key = "tenant-a"
    harness.admit([first])
    harness.prefill()
    harness.evict_all()
    other = model.request(harness, prompt, "b1")
    other.extra_key = "tenant-b"
    again = model.request(harness, prompt, "a2")
    again.extra_key = "tenant-a"
    assert harness.admit([other]) == [other] and other.prefix_len == 0 and cache.stats.loads == 0
    harness.prefill()
    assert harness.admit([again]) == [again]
    assert again.prefix_len > 0, (again.prefix_len, cache.stats)
    assert cache.stats.loads == 1
    harness.drain()
    harness.evict_all()
    harness.check()


@pytest.mark.parametrize("chunked", [None, 32], ids=["whole", "chunked"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_200_random_requests_leak_no_slot_and_matching_changes_nothing(
    page_size: int, chunked: int | None
) -> None:
    backend = _backend("qwen2")
    harness, _ = _setup(backend, page_size, UNBOUNDED, size=768, chunked_prefill_size=chunked)
    harness.on_extend = functools.partial(stamp_kv, harness.kv_pool)  # values do not matter here: slots do
    cache = harness.tree_cache
    rng = random.Random(13)
    pieces = [
        _text(backend, f"note {i}: " + " ".join(rng.choice("abcdefgh") * 3 for _ in range(4)))
        for i in range(8)
    ]
    anchor = backend.anchor.input_ids.tolist()
    sent = chunks = 0
    for step in range(200):
        chosen = rng.sample(pieces, rng.randint(1, 4))
        tokens = anchor + [t for piece in chosen for t in piece.input_ids.tolist()] + [rng.randint(10, 90)]
        req = harness.request(
            tokens, max_new_tokens=rng.randint(1, 3), extra_key=rng.choice([None, None, "t"])
        )
        with harness.active():
            from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
            from sglang.srt.mem_cache.common import _req_radix_key

            key = _req_radix_key(cache, req, req.origin_input_ids, len(tokens) - 1)
            free, size = harness.free_slots(), cache.total_size()
            one = cache.match_prefix(MatchPrefixParams(key=key, req=req))
            two = cache.match_prefix(MatchPrefixParams(key=key, req=req))
            assert (one.device_prefix_len, one.host_hit_length) == (
                two.device_prefix_len,
                two.host_hit_length,
            )
            assert (harness.free_slots(), cache.total_size()) == (free, size)
        harness.admit([req])
        sent += 1
        chunks += harness.chunked is not None
        if harness.batch is not None:
            harness.prefill()
        if rng.random() < 0.3:
            harness.decode()
        if step % 10 == 9:
            harness.evict(rng.randint(16, 256))
        harness.check()
    _finish_every_request(harness)
    assert sent == 200 and cache.stats.loads > 10 and cache.stats.chunks_captured > 10
    assert (chunks > 20) is (chunked is not None)  # most prompts are longer than a chunk of 32


def test_a_load_that_cannot_be_written_is_declined_and_leaks_nothing() -> None:
    backend = _backend("qwen2")
    harness, model = _setup(backend, 1, WindowConfig.exact())
    cache = harness.tree_cache
    chunks = [_text(backend, "a note the store keeps"), _text(backend, "and another one")]
    _run(harness, model, _prompt(backend, [*chunks, _text(backend, "q")]), "first")
    harness.prefill()
    harness.evict_all()
    other = text_backend("deepseek_v2", layers=4).layout  # an MLA layout: this MHA pool refuses it
    cache.layout = replace(cache.layout, kind=other.kind, keys_shape=other.keys_shape)
    req = _run(harness, model, _prompt(backend, [*chunks, _text(backend, "q2")]), "second")
    assert req.prefix_len == 0 and cache.stats.failed == 1 and cache.stats.loads == 0
    harness.drain()
    harness.evict_all()
    assert harness.free_slots() == harness.capacity
    harness.check()


FAULTS = (IndexError, AttributeError, ValueError, KeyError, TimeoutError)


def test_faults_in_every_hook_never_fail_a_request_or_leak_a_slot() -> None:
    """kamera's code under each hook (planning, loading, writing, capturing, releasing) raises
    IndexError, AttributeError, ValueError, KeyError and a store timeout in turn, every other
    call: SGLang's real admission path serves all 120 requests, every slot comes back, the tree
    stays consistent, and each fault is counted at its hook's boundary."""
    backend = _backend("qwen2")
    harness, _ = _setup(backend, 1, UNBOUNDED, size=768)
    harness.on_extend = functools.partial(stamp_kv, harness.kv_pool)
    cache = harness.tree_cache
    assert cache.synthesis is not None
    targets = [(cache, "_plan"), (cache.synthesis, "load"), (cache, "_write"), (cache, "_capture")]
    targets += [(cache.synthesis, "loaded"), (cache, "_cut")]
    for owner, name in targets[:-1]:
        original, calls = getattr(owner, name), [0]

        def faulty(*args: Any, _original: Any = original, _calls: list[int] = calls, **kwargs: Any) -> Any:
            _calls[0] += 1
            if _calls[0] % 2 == 1 and _calls[0] // 2 < len(FAULTS):
                raise FAULTS[_calls[0] // 2](f"injected fault {_calls[0] // 2}")
            return _original(*args, **kwargs)

        setattr(owner, name, faulty)

    class FaultyCuts(dict):  # type: ignore[type-arg]
        pops = 0

        def pop(self, *args: Any) -> Any:
            FaultyCuts.pops += 1
            if FaultyCuts.pops <= len(FAULTS):
                raise FAULTS[FaultyCuts.pops - 1]("injected fault")
            return super().pop(*args)

    from collections import OrderedDict

    cuts = type("Cuts", (FaultyCuts, OrderedDict), {})()
    cache._cut = cuts
    rng = random.Random(29)
    pieces = [
        _text(backend, f"note {i}: " + " ".join(rng.choice("abcdefgh") * 3 for _ in range(4)))
        for i in range(6)
    ]
    anchor = backend.anchor.input_ids.tolist()
    for step in range(120):
        chosen = rng.sample(pieces, rng.randint(1, 4))
        tokens = anchor + [t for piece in chosen for t in piece.input_ids.tolist()] + [rng.randint(10, 90)]
        harness.admit([harness.request(tokens, max_new_tokens=rng.randint(1, 3))])
        if harness.batch is not None:
            harness.prefill()
        harness.drain()
        if step % 10 == 9:
            harness.evict(rng.randint(16, 256))
        harness.check()
    _finish_every_request(harness)
    faults = cache.faults.as_dict()
    hooks = {key.split(":")[0] for key in faults}
    assert {"match_prefix", "init_load_back", "checkpoint", "on_release"} <= hooks, faults
    assert {key.split(":")[1] for key in faults} >= {
        "IndexError",
        "AttributeError",
        "ValueError",
        "KeyError",
        "TimeoutError",
    }
    assert cache.stats.loads > 0  # between the faults, kamera still served


def _finish_every_request(harness: Admission) -> None:
    """Run every admitted and waiting request to its end, evict the tree, and check that every
    slot came back."""
    while harness.waiting or harness.batch is not None or harness.running or harness.chunked is not None:
        if harness.batch is not None:
            harness.prefill()
        harness.drain()
        harness.admit()
    harness.evict_all()
    assert harness.free_slots() == harness.capacity and harness.tree_cache.total_size() == 0
    harness.check()


def test_at_the_default_budget_a_kept_state_nobody_audited_is_computed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The window's default settings in SGLang: the model's calibrated drift budget. A moved chunk
    whose kept state no audit vouches for is not loaded: SGLang computes it (counted refused);
    without a calibration the plugin serves exactly, with one warning."""
    backend = _backend("qwen2")
    monkeypatch.setenv(CALIBRATION_DIR_VARIABLE, str(tmp_path))
    with pytest.warns(UncalibratedWarning):
        harness, _ = _setup(backend, 1, WindowConfig())
    assert harness.tree_cache.synthesis.mode == "exact"
    save_calibration(Calibration(backend.fingerprint, scale=1.0, inherit=0.5, budget=0.5), tmp_path)
    harness, model = _setup(backend, 1, WindowConfig())
    cache = harness.tree_cache
    assert cache.synthesis.mode == "keep" and cache.synthesis.budget.epsilon == 0.5
    with caplog.at_level(logging.INFO, logger=RADIX_LOGGER):
        move_a_chunk(harness, model)
    assert cache.stats.loads == 0 and cache.stats.tokens_kept == 0
    assert cache.stats.kept_refused >= 1
    assert "request moved loaded 0 prompt tokens, 0 kept" in _reports(caplog, "moved")
    assert "a kept state was refused" in _reports(caplog, "moved")
    harness.check()


def test_each_request_reports_its_kept_tokens_and_their_drift(caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's outputs carry no per-request field for kamera: the plugin logs one line per
    loaded request with its loaded and kept tokens and the largest estimated drift served."""
    backend = _backend("qwen2")
    harness, model = _setup(backend, 1, UNBOUNDED)
    cache = harness.tree_cache
    with caplog.at_level(logging.INFO, logger=RADIX_LOGGER):
        move_a_chunk(harness, model)
    kept = cache.stats.tokens_kept
    assert kept > 0
    report = _reports(caplog, "moved")
    assert f"loaded {cache.stats.tokens_loaded} prompt tokens, {kept} kept (approximate)" in report
    assert "refused" not in report
    harness.check()


RADIX_LOGGER = "kamera_agent.engines.sglang.radix"


def _reports(caplog: pytest.LogCaptureFixture, rid: str) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if f"request {rid} " in r.getMessage())


def test_an_unsalted_request_is_never_served_a_kept_state() -> None:
    """What a load writes enters SGLang's tree under the request's own tokens, which any later
    request of its namespace may match: a kept (approximate) state is loaded only for a request
    with a ``cache_salt``, as in vLLM. Unsalted, the moved chunk is computed by SGLang."""
    backend = _backend("qwen2")
    harness, model = _setup(backend, 1, UNBOUNDED)
    model.salt = None
    cache = harness.tree_cache
    move_a_chunk(harness, model)
    assert cache.stats.tokens_kept == 0 and cache.synthesis.kept_loads == ()
    harness.check()
