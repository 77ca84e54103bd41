"""An entry gone or unreadable when SGLang loads it: computed at once, counted, offered no more.

Through SGLang's real admission path (`tests/engines/sglang/harness.py`): a request is captured,
SGLang's tree is emptied, and the store then claims the captured entries while it has lost them
(each read finds it gone) or cannot read them (every read fails): `kamera_agent.testing.ShakyTier`.
The next request is offered them (``match_prefix``), its load fails (``init_load_back``), and
SGLang computes it at once; a request matched right after it is not offered them; each failed
entry is a counted, logged fault; the request's capture files them anew, and the request after
is served them, the pool holding the model's own KV.
"""

from __future__ import annotations

import logging

import pytest

from kamera_agent.config import WindowConfig
from kamera_agent.operator.layout import to_position_free
from kamera_agent.store import ChunkStore
from kamera_agent.testing import ShakyTier
from tests.engines.sglang.test_radix import (
    EXACT,
    _backend,
    _part,
    _pool_kv,
    _prompt,
    _rel,
    _run,
    _setup,
    _text,
)


@pytest.mark.parametrize("loss", ["lost", "unreadable"])
def test_an_entry_gone_or_unreadable_at_its_load_is_computed_counted_and_offered_no_more(
    loss: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = _backend("qwen2")
    harness, model = _setup(backend, 1, WindowConfig.exact())
    cache = harness.tree_cache
    assert cache.synthesis is not None
    notes = ["notes from the first morning", "a red ball rolled under the old table", "then rain"]
    chunks = [_text(backend, note) for note in notes]
    _run(harness, model, _prompt(backend, [*chunks, _text(backend, "what rolled?")]), "first")
    harness.drain()
    captured = cache.synthesis.store.keys()  # type: ignore[attr-defined]
    shaky = ShakyTier(**{loss: captured})
    cache.synthesis.store = ChunkStore(fingerprint=backend.fingerprint, memory_limit=1 << 28, tiers=[shaky])
    harness.evict_all()

    second = _prompt(backend, [*chunks, _text(backend, "what fell?")])
    twin = _prompt(backend, [*chunks, _text(backend, "what rained?")])
    reqs = [model.request(harness, second, "second"), model.request(harness, twin, "twin")]
    with caplog.at_level(logging.WARNING, logger="kamera_agent.engines.sglang.radix"):
        assert harness.admit(reqs) == reqs
    # the offer's load failed: SGLang computes the request at once; the twin, matched after it,
    # is offered nothing (one offer in all, each entry read once)
    assert [req.prefix_len for req in reqs] == [0, 0]
    assert (cache.stats.failed, cache.stats.loads) == (1, 0)
    offered = len(shaky.reads)  # every chunk before the question
    assert offered >= 4 and set(shaky.reads.values()) == {1}
    kind = "LostEntry" if loss == "lost" else "UnreadableEntry"
    assert cache.faults.as_dict() == {f"init_load_back:{kind}": offered}
    assert f"init_load_back: {kind}" in caplog.text  # logged (once per kind)

    harness.drain()  # computed by the forward, its chunks filed anew
    harness.evict_all()
    third = _prompt(backend, [*chunks, _text(backend, "what was under it?")])
    req = _run(harness, model, third, "third")
    hit = third.bounds[3][1]
    assert req.prefix_len == hit and (cache.stats.loads, cache.stats.failed) == (1, 1)  # offer two, served
    assert sum(shaky.reads.values()) == offered  # served from the entries filed anew
    got = _pool_kv(harness, backend, harness.row(req, hit), third.positions[..., :hit])
    want = to_position_free(_part(third.kv, 0, hit), backend.layout)
    assert _rel(got.keys, want.keys) < EXACT and _rel(got.values, want.values) < EXACT
    harness.drain()
    harness.evict_all()
    assert harness.free_slots() == harness.capacity
    harness.check()
