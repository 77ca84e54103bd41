"""The admission harness over SGLang 0.5.23's stock ``RadixCache`` (run in .venv-sglang).

These pin the harness itself: what SGLang's real admission path does with a plain radix tree is
the reference any custom radix cache driven through the same harness is held to.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engines.sglang.harness import Admission, HarnessError


def _radix_cache(params):  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache(params)


def _prefix_holds_its_own_kv(harness: Admission, req) -> None:  # type: ignore[no-untyped-def]
    """The slots a request reuses hold the KV its own tokens would have produced, at their positions."""
    tokens, positions = harness.kv_stamp(harness.row(req, req.prefix_len))
    fill = req.origin_input_ids + req.output_ids  # a retracted request is matched with its output
    assert tokens == list(fill[: req.prefix_len])
    assert positions == list(range(req.prefix_len))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("first_finished", [True, False], ids=["after-finish", "while-running"])
def test_a_second_request_reuses_the_first_ones_slots(page_size: int, first_finished: bool) -> None:
    harness = Admission(_radix_cache, page_size=page_size, size=1024)
    shared = list(range(10, 40))  # 30 tokens: all reusable at page size 1, one page at page size 16
    first = harness.request([*shared, *range(100, 110)], max_new_tokens=1 if first_finished else 4)
    assert harness.admit([first]) == [first]
    assert first.prefix_len == 0
    first_slots = harness.new_slots(first).clone()
    assert torch.equal(harness.row(first), first_slots)
    harness.check()
    assert harness.prefill() == ([first] if first_finished else [])
    assert (first in harness.running) is not first_finished
    harness.check()

    second = harness.request([*shared, 200, 201, 202])
    assert harness.admit([second]) == [second]
    expected = len(shared) // page_size * page_size
    assert second.prefix_len == expected
    assert second.kv.cache_protected_len == expected
    row = harness.row(second)
    assert torch.equal(row[:expected], first_slots[:expected])
    assert torch.equal(row[expected : second.extend_end], harness.new_slots(second))
    assert not set(harness.new_slots(second).tolist()) & set(first_slots[:expected].tolist())
    _prefix_holds_its_own_kv(harness, second)
    harness.check()

    harness.drain()
    assert not harness.running and harness.batch is None
    harness.check()
    harness.evict_all()
    assert harness.free_slots() == harness.capacity
    assert harness.tree_cache.total_size() == 0
    harness.check()


def test_an_extra_key_keeps_requests_apart() -> None:
    harness = Admission(_radix_cache, size=512)
    tokens = list(range(10, 30))
    harness.admit([harness.request(tokens, extra_key="tenant-a")])
    harness.prefill()
    other = harness.request(tokens, extra_key="tenant-b")
    same = harness.request(tokens, extra_key="tenant-a")
    assert harness.admit([other, same]) == [other, same]
    assert other.prefix_len == 0
    assert same.prefix_len == len(tokens) - 1  # the last token is always recomputed
    harness.drain()
    harness.evict_all()
    assert harness.free_slots() == harness.capacity
    harness.check()


def test_the_check_catches_a_slot_nobody_owns() -> None:
    harness = Admission(_radix_cache, size=256)
    stray = harness.allocator.alloc(1)
    with pytest.raises(HarnessError, match="unaccounted"):
        harness.check()
    harness.allocator.free(stray)
    harness.check()


def _broken_caches():  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.radix_cache import RadixCache

    class _Silenced:
        """Drop the allocator's frees while inside the block: the slots leak."""

        def __init__(self, cache) -> None:  # type: ignore[no-untyped-def]
            self.allocator = cache.token_to_kv_pool_allocator

        def __enter__(self) -> None:
            self.kept = self.allocator.free_segment
            self.allocator.free_segment = lambda *args, **kwargs: None

        def __exit__(self, *exc: object) -> None:
            self.allocator.free_segment = self.kept

    class LeaksOnEvict(RadixCache):  # type: ignore[misc]
        def evict(self, params):  # type: ignore[no-untyped-def]
            with _Silenced(self):
                return super().evict(params)

    class KeepsDuplicates(RadixCache):  # type: ignore[misc]
        def _insert_cache(self, req, token_ids, **kwargs):  # type: ignore[no-untyped-def]
            with _Silenced(self):
                return super()._insert_cache(req, token_ids, **kwargs)

    class DropsTheLock(RadixCache):  # type: ignore[misc]
        def checkpoint(self, req, *, up_to):  # type: ignore[no-untyped-def]
            super().checkpoint(req, up_to=up_to)
            self.unlock(req.lock)
            req.lock = None

    return {
        "leaks-on-evict": LeaksOnEvict,
        "keeps-duplicates": KeepsDuplicates,
        "drops-the-lock": DropsTheLock,
    }


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("bug", "message"),
    [
        ("leaks-on-evict", "unaccounted"),
        ("keeps-duplicates", "unaccounted"),
        ("drops-the-lock", "no longer holds"),
    ],
)
def test_the_check_catches_a_cache_that_loses_slots(bug: str, message: str, page_size: int) -> None:
    harness = Admission(_broken_caches()[bug], page_size=page_size, size=512)
    tokens = list(range(10, 50))
    # Two prompts sharing 40 tokens in one batch: both compute them, so the second one's insert
    # finds duplicates; the first finishes (its tail is evictable), the second keeps running.
    harness.admit([harness.request([*tokens, *range(60, 80)]), harness.request(tokens, max_new_tokens=8)])
    with pytest.raises(HarnessError, match=message):
        harness.prefill()
        harness.check()
        harness.evict_all()
        harness.check()


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_long_prompt_is_prefilled_in_chunks_each_published_before_the_next(page_size: int) -> None:
    harness = Admission(_radix_cache, page_size=page_size, size=1024, chunked_prefill_size=32)
    tokens = list(range(10, 110))
    long = harness.request(tokens, max_new_tokens=3)
    assert harness.admit([long]) == [long] and harness.chunked is long
    sharer = harness.request([*tokens[:40], 5])
    ends = []
    while not long.output_ids:
        ends.append(long.extend_end)
        harness.prefill()
        harness.check()
        if harness.chunked is long:  # a middle chunk: nothing sampled, its KV in the tree
            assert long not in harness.running and harness.row(long).shape[0] == long.extend_end
            assert harness.tree_cache.total_size() == long.extend_end // page_size * page_size
            # a request sharing its head waits while a full chunk takes the pass's chunk budget,
            # and is admitted beside the last one, reusing what the chunks published
            admitted = harness.admit([sharer] if len(ends) == 1 else [])
            assert admitted == ([long] if long.extend_end < len(tokens) else [long, sharer])
    assert ends == [32, 64, 96, 100] and long in harness.running and sharer in harness.finished
    assert sharer.prefix_len == 40 // page_size * page_size
    second = harness.request([*tokens[:70], 5, 6])
    assert harness.admit([second]) == [second]
    assert second.prefix_len == 70 // page_size * page_size
    _prefix_holds_its_own_kv(harness, second)
    harness.check()
    harness.drain()
    harness.evict_all()
    assert harness.free_slots() == harness.capacity
    harness.check()


def _random_tokens(rng: random.Random, stems: list[list[int]]) -> list[int]:
    length = rng.randint(5, 80)
    shared = rng.randint(0, length)
    return rng.choice(stems)[:shared] + [rng.randint(10, 13) for _ in range(length - shared)]


# roomy: every request is admitted at once, the pool still fills (allocation evicts the tree).
# tight: requests queue for memory, decode runs out and retracts, the waiting queue is matched
# again and again (longest-prefix-match policy).
POOLS = {
    "roomy": {
        "size": 1024,
        "max_new_tokens": 6,
        "finish": 0.5,
        "new_token_ratio": 0.7,
        "schedule_policy": "fcfs",
    },
    "tight": {
        "size": 384,
        "max_new_tokens": 40,
        "finish": 0.2,
        "new_token_ratio": 0.1,
        "schedule_policy": "lpm",
    },
}


@pytest.mark.parametrize("chunked", [None, 32], ids=["whole", "chunked"])
@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize("page_size", [1, 16])
def test_200_random_requests_return_every_slot(page_size: int, pool: str, chunked: int | None) -> None:
    """Prompts of up to 80 tokens; with chunked prefill (SGLang's default) of 32 tokens, most are
    prefilled over two or three passes, other requests admitted beside their chunks."""
    shape = POOLS[pool]
    rng = random.Random(1234 + page_size)
    harness = Admission(
        _radix_cache,
        page_size=page_size,
        size=shape["size"],
        max_requests=16,
        new_token_ratio=shape["new_token_ratio"],
        schedule_policy=shape["schedule_policy"],
        chunked_prefill_size=chunked,
    )
    stems = [[rng.randint(10, 13) for _ in range(80)] for _ in range(6)]
    hits = evicted = queued = chunks = 0
    for i in range(200):
        req = harness.request(
            _random_tokens(rng, stems),
            extra_key=rng.choice([None, None, None, "lora-a"]),
            max_new_tokens=rng.randint(1, shape["max_new_tokens"]),
        )
        for admitted in harness.admit([req]):
            hits += admitted.prefix_len
            _prefix_holds_its_own_kv(harness, admitted)
        queued = max(queued, len(harness.waiting))
        harness.check()
        if harness.batch is not None:
            chunks += harness.chunked is not None
            harness.prefill()
            harness.check()
        roll = rng.random()
        if harness.running and roll < shape["finish"]:
            harness.finish(rng.choice(harness.running))  # random finish order
        elif harness.running and roll < 0.8:
            harness.decode()
        harness.check()
        if i % 10 == 9:
            evicted += harness.evict(rng.randint(1, 256))
            harness.check()
    while harness.waiting or harness.running or harness.batch is not None or harness.chunked is not None:
        for admitted in harness.admit():
            _prefix_holds_its_own_kv(harness, admitted)
        harness.drain()
        harness.check()

    assert (chunks > 20) is (chunked is not None)
    assert len(harness.finished) == 200 and len({r.rid for r in harness.finished}) == 200
    assert hits > 0 and evicted > 0  # prefixes were shared and the tree was evicted under use
    assert (queued > 0) is (pool == "tight" or chunked is not None)  # or a chunk took the pass's budget
    assert harness.tree_cache.protected_size() == 0
    harness.evict_all()
    assert harness.tree_cache.total_size() == 0
    assert harness.free_slots() == harness.capacity == shape["size"]
    assert harness.req_to_token_pool.available_size() == harness.row_capacity
    harness.check()
