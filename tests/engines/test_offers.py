"""Entries whose load failed are not offered again until the store has them afresh.

The planner here is `PrefixSynthesis` over a store that says "present" for every entry it was
given while every read of one fails (a store that lost it after the offer, or holds it
unreadable): what an engine adapter sees when a load fails. The engines' own harnesses run the
same through vLLM's and SGLang's schedulers (tests/engines/vllm/test_lost.py,
tests/engines/sglang/test_lost.py).
"""

from __future__ import annotations

import torch

from kamera_agent.engines.chunking import keyed
from kamera_agent.engines.offers import FailedEntries
from kamera_agent.engines.synthesis import PrefixSynthesis
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import EntryKey
from kamera_agent.testing import UnreadableEntries


def _request() -> list:  # type: ignore[type-arg]
    tokens = list(range(40))
    return keyed(tokens, [(0, 8, "text"), (8, 24, "text"), (24, 40, "text")])


def _kv(n: int) -> ChunkKV:
    return ChunkKV(torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_entry_every_read_of_which_fails_is_offered_at_most_twice_a_period() -> None:
    store, clock = UnreadableEntries(), Clock()
    synthesis = PrefixSynthesis(store, "exact", failed=FailedEntries(retry_after=60.0, clock=clock))
    chunks = _request()
    for chunk, _, entry in synthesis.captures("", chunks, 40):  # a first request computed and captured
        synthesis.write(entry, _kv(len(chunk)))
    offers = 0
    for _ in range(100):  # requests that hold the same chunks, one after another
        plan = synthesis.plan("", chunks, 0, 39)
        if plan.tokens == 0:  # computed: its capture files the entries the load could not read
            for chunk, _, entry in synthesis.captures("", chunks, 40):
                synthesis.write(entry, _kv(len(chunk)))
            continue
        offers += 1
        assert not synthesis.load(plan).ok  # every read fails
    assert offers == 2, offers  # once; once more after it was filed anew; then blocked
    assert store.reads == 2 * len(chunks)  # each offer read every chunk's entry once
    clock.now = 61.0  # a minute on: asked again (another process may have filed it since)
    assert synthesis.plan("", chunks, 0, 39).tokens > 0


def test_a_failed_entry_is_captured_anew_and_a_written_load_clears_it() -> None:
    failed, entry = FailedEntries(), EntryKey.full("chunk", "state")
    assert not failed.blocked(entry)
    failed.failed([entry])
    assert failed.blocked(entry) and len(failed) == 1
    failed.refiled([entry])
    assert not failed.blocked(entry)  # filed anew after one failure: offered again
    failed.loaded([entry])
    assert len(failed) == 0
    failed.failed([entry])
    failed.failed([entry])  # requests offered it together: one failure
    failed.refiled([entry])
    assert not failed.blocked(entry)
    failed.failed([entry])  # failed again once filed anew: blocked, re-filed or not
    failed.refiled([entry])
    assert failed.blocked(entry)
