"""The pieces that bound a request, each alone: text by length, schemas by expansion, decoding
memory by tenant and in all, caches by bytes, and turns at the model.

Why apart from the live attacks: each rule has edges (a ref inside an allOf, a request whose
images fit one by one but not together, a waiter whose session is busy) that are quicker and
clearer to pin here than through a server.
"""

from __future__ import annotations

import threading
import time

import pytest

from kamera_agent.serve.bounds import SchemaBound, TextBound, expansion
from kamera_agent.serve.lru import ByteLRU
from kamera_agent.serve.pixels import BYTES_PER_PIXEL, PixelLimit
from kamera_agent.serve.protocol import RequestError
from kamera_agent.serve.scheduler import ModelTurns


def _nested(levels: int) -> dict[str, object]:
    if levels == 0:
        return {"type": "integer"}
    return {"anyOf": [{"type": "object", "properties": {k: _nested(levels - 1)}} for k in "abc"]}


def test_a_schema_is_counted_as_a_compiler_expands_it() -> None:
    small = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}}
    assert expansion(small, 100) == 6
    assert expansion(_nested(9), 10_000) == 10_001  # 3^9 branches written out: over, counting stops
    shared = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 3} for i in range(12)}
    refs = {"$defs": {**shared, "d12": {"type": "integer"}}, "$ref": "#/$defs/d0"}
    assert expansion(refs, 10_000) < 200  # each rule once: what a compiler builds
    parts = [{"$ref": f"#/$defs/d{i}"} for i in range(12)]
    crossed = {
        "$defs": {f"d{i}": {"anyOf": [{"type": t} for t in ("integer", "string", "null")]} for i in range(12)}
    }
    assert expansion({**crossed, "allOf": parts}, 10_000) == 10_001  # an intersection multiplies


def test_a_schema_over_its_bound_is_refused_by_name() -> None:
    bound = SchemaBound(max_chars=10_000, max_nodes=50)
    bound.check({"type": "object"}, "response_format.schema", "response_format")
    with pytest.raises(RequestError, match="characters is over") as long:
        bound.check({"description": "x" * 20_000}, "response_format.schema", "response_format")
    with pytest.raises(RequestError, match="expands to over 50 nodes") as wide:
        bound.check(_nested(3), "response_format.schema", "response_format")
    assert long.value.param == wide.value.param == "response_format"


def test_text_past_the_context_by_its_length_alone_is_refused() -> None:
    bound = TextBound(context=100, token_bytes=4)
    bound.check(400, "messages[1].content")
    with pytest.raises(RequestError, match="401 characters cannot fit") as refused:
        bound.check(401, "messages[1].content")
    assert refused.value.code == "context_length_exceeded" and "messages[1].content" in refused.value.message
    TextBound(context=None).check(10**9, "anything")  # no context known: nothing refused


def test_decoding_memory_is_held_by_tenant_and_in_all() -> None:
    side = 100
    one = side * side * BYTES_PER_PIXEL
    budget = PixelLimit(total=3 * one, per_tenant=2 * one)
    with budget.lease("a") as first, budget.lease("a") as second:
        first.take(side, side, "a0")
        second.take(side, side, "a1")
        with pytest.raises(RequestError) as busy:  # a's share is taken: retry later
            budget.lease("a").take(side, side, "a2")
        assert busy.value.status == 429
        with budget.lease("b") as other:
            other.take(side, side, "b0")  # another tenant still has room
            with pytest.raises(RequestError) as full:
                budget.lease("c").take(side, side, "c0")  # the server's is taken
            assert full.value.status == 429
    assert budget.held == 0
    with budget.lease("a") as greedy:
        greedy.take(side, side, "x0")
        with pytest.raises(RequestError) as never:  # this request alone could never fit
            greedy.take(2 * side, side, "x1")
        assert never.value.status == 400


def test_a_cache_holds_bytes_not_entries() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(100, len)
    cache.put("a", b"x" * 60)
    cache.put("b", b"x" * 30)
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("c", b"x" * 30)  # 120 > 100: b leaves
    assert cache.get("b") is None and cache.nbytes == 90 and len(cache) == 2
    cache.put("huge", b"x" * 101)  # larger than the whole budget: never kept
    assert cache.get("huge") is None and cache.nbytes == 90


def test_turns_hand_the_model_on_and_pass_over_a_waiter_not_ready() -> None:
    turns = ModelTurns()
    order: list[str] = []
    free = threading.Event()

    def short(name: str) -> None:
        with turns.turn():
            order.append(name)

    def pinned() -> None:
        with turns.turn() as turn:
            turn.wait_until(free.is_set)
            order.append("pinned")

    with turns.turn() as long:
        waiter = threading.Thread(target=pinned)
        waiter.start()
        while turns.waiting < 1:
            time.sleep(0.001)
        other = threading.Thread(target=short, args=("short",))
        other.start()
        while turns.waiting < 2:  # both wait: the pinned request first
            time.sleep(0.001)
        long.step()  # a decode step: the pinned request gets the model, finds its session busy
        # and gives it up; the short one is served, and the model comes back here
        assert order == ["short"]
    other.join(timeout=10)
    free.set()
    with turns.turn():
        pass  # a turn ending lets the waiter look again
    waiter.join(timeout=10)
    assert order == ["short", "pinned"] and turns.steps == 1
