"""Test doubles for code written against kamera's seams: a backend, a store tier, an engine's pool.

Why shipped (as httpx ships ``MockTransport``): whoever writes a `Tier`, a `Backend` or an engine
adapter outside this repository tests it against the same doubles kamera's own tests use, each
behind the real seam, so every layer above runs unchanged:

    CountingBackend(inner)     a backend wrapped: counts and times every primitive, can fail a prefill
    FakeTier()                 encoded entries in a dict, told to stop answering with ``down``
    ShakyTier(lost, unreadable) entries a tier claims and cannot serve (evicted, or damaged)
    UnreadableEntries()        an engine's entry store that holds what it is given, serves none
    DictSlots(layout)          an engine's KV pool as a dict of token slots (`KVSlots`)

For example, a store whose tier went away computes instead of failing, and counts the outage:

    from kamera_agent.store import ChunkStore
    from kamera_agent.testing import FakeTier

    tier = FakeTier()
    store = ChunkStore(fingerprint="f" * 64, memory_limit=1 << 20, tiers=[tier])
    tier.down = True
    assert store.get_canonical("absent") is None and store.stats().unavailable == 1

Only torch and kamera itself are imported (no test runner): the doubles work under any.
Nothing in the package imports this module (an import contract holds it).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from kamera_agent.backends.base import (
    Backend,
    Prefilled,
    Reference,
)
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.engines.slots import KVSlots
from kamera_agent.operator.layout import ChunkKV, KVLayout
from kamera_agent.store import EntryKey
from kamera_agent.store.codec import CorruptEntry, header_of
from kamera_agent.store.tier import Entry, Lookup, Meta, Payload, Status, Tier, Write

__all__ = ["CountingBackend", "DictSlots", "FakeTier", "ShakyTier", "UnreadableEntries"]

PRIMITIVES = (
    "prefill",
    "encode_vision",
    "assemble",
    "crop",
    "read_slots",
    "decode",
    "recompute",
    "deviation",
)
"""The primitives `CountingBackend` counts (the reference forwards are checks, not counted)."""


def _forwarded(primitive: str) -> Callable[..., Any]:
    """``inner``'s ``primitive``, counted and timed (the seam's arguments passed on as given)."""

    def call(self: CountingBackend, *args: Any, **kwargs: Any) -> Any:
        with self._counted(primitive):
            return getattr(self.inner, primitive)(*args, **kwargs)

    call.__name__, call.__qualname__ = primitive, f"CountingBackend.{primitive}"
    return call


class CountingBackend(Backend):
    """Another backend behind the same seam, counting and timing every primitive call (and able
    to fail one).

    A window over it behaves exactly like one over ``inner``, so a test can assert what an op
    ran (that a dry run called nothing, that an answer appended onto a retained cache) and a
    benchmark can tell the model's time from the rest of a request's.

    Args:
        inner: the backend that does the work.
        fail_prefill_at: the n-th `prefill` (1-based) raises `RuntimeError`: an engine failing
            mid-op (the op must leave the window and the store as they were).
        extend: override the engine's `Capabilities.extend` (``False``: every answer assembles
            its cache anew).

    Attributes:
        calls: primitive name -> calls so far (`PRIMITIVES`).
        seconds: primitive name -> wall seconds spent in ``inner``'s calls of it.
        assembles: each `assemble` call's placed pieces and whether it appended onto a cache.
    """

    def __init__(
        self, inner: Backend, fail_prefill_at: int | None = None, *, extend: bool | None = None
    ) -> None:
        self.inner, self.fail_prefill_at = inner, fail_prefill_at
        self.calls: Counter[str] = Counter(dict.fromkeys(PRIMITIVES, 0))
        self.seconds: dict[str, float] = dict.fromkeys(PRIMITIVES, 0.0)
        self.assembles: list[tuple[int, bool]] = []
        self.layout, self.fingerprint, self.encoder = inner.layout, inner.fingerprint, inner.encoder
        extended = inner.capabilities.extend if extend is None else extend
        self.capabilities = replace(inner.capabilities, extend=extended)

    def total(self) -> int:
        """Primitive calls so far, all kinds together."""
        return sum(self.calls.values())

    @contextmanager
    def _counted(self, primitive: str) -> Iterator[None]:
        self.calls[primitive] += 1
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[primitive] += time.perf_counter() - began

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    @property
    def context_limit(self) -> int | None:
        return self.inner.context_limit

    def prefill(self, *args: Any, **kwargs: Any) -> Prefilled:
        with self._counted("prefill"):
            if self.calls["prefill"] == self.fail_prefill_at:
                raise RuntimeError("the engine failed mid-op")
            return self.inner.prefill(*args, **kwargs)

    def assemble(self, placed: Sequence[ChunkKV], onto: Any | None = None) -> Any:
        self.assembles.append((len(placed), onto is not None))
        with self._counted("assemble"):
            return self.inner.assemble(placed, onto)

    encode_vision = _forwarded("encode_vision")
    crop = _forwarded("crop")
    read_slots = _forwarded("read_slots")
    decode = _forwarded("decode")
    recompute = _forwarded("recompute")
    deviation = _forwarded("deviation")

    def reference_prefill(
        self, chunks: Sequence[Chunk], query_ids: torch.Tensor | None = None, *, anchor: Chunk | None = None
    ) -> Reference:
        return self.inner.reference_prefill(chunks, query_ids, anchor=anchor)

    def reference_inputs(
        self, chunks: Sequence[Chunk], query_ids: torch.Tensor | None = None, *, anchor: Chunk | None = None
    ) -> dict[str, Any]:
        return self.inner.reference_inputs(chunks, query_ids, anchor=anchor)


class FakeTier(Tier):
    """Encoded entries in a dict; ``down`` makes every lookup `Status.UNAVAILABLE`.

    The store's walk over its tiers, its one decode-and-verify path and its counting run against
    it without a server. A subclass with ``from_url`` is a tier opened by URL scheme.

    Args:
        calls: where each lookup is logged as ``"<label>.get"`` / ``"<label>.contains"`` (share
            one list between tiers to see the order they were asked in).
        label: the name in that log.

    Attributes:
        data: entry key -> its serialized bytes (what a put wrote; a test may plant any bytes).
        down: every lookup answers unavailable (a tier that did not answer, not an absence).
        rejected: each entry the store refused on reading it, with why (then dropped).
    """

    name = "fake"
    locked = False
    written_on_put = True

    def __init__(self, calls: list[str] | None = None, label: str = "fake") -> None:
        self.data: dict[EntryKey, bytes] = {}
        self.down = False
        self.calls = [] if calls is None else calls
        self.label = label
        self.rejected: list[tuple[EntryKey, str]] = []

    def get(self, key: EntryKey) -> Lookup[Payload]:
        self.calls.append(f"{self.label}.get")
        if self.down:
            return Lookup.unavailable("the fake is down")
        blob = self.data.get(key)
        return Lookup.miss() if blob is None else Lookup.hit(blob)

    def put(self, entry: Entry) -> Write:
        self.data[entry.key] = entry.serialize()
        return Write.done()

    def contains(self, key: EntryKey) -> Status:
        self.calls.append(f"{self.label}.contains")
        if self.down:
            return Status.UNAVAILABLE
        return Status.HIT if key in self.data else Status.MISS

    def drop(self, key: EntryKey) -> None:
        self.data.pop(key, None)

    def peek(self, key: EntryKey) -> Lookup[Meta]:
        if self.down:
            return Lookup.unavailable("the fake is down")
        return Lookup.miss() if key not in self.data else Lookup.hit(header_of(self.data[key]))

    def reject(self, key: EntryKey, why: CorruptEntry) -> None:
        self.rejected.append((key, str(why)))
        self.drop(key)


class ShakyTier(Tier):
    """Entries filed elsewhere that this tier claims to hold and never serves: ``lost`` ones
    until first read (evicted between an engine's offer and its load), ``unreadable`` ones for
    good (held, but damaged, refused or too slow). Engines plan from presence and load later;
    this is what they meet in between.

    Attributes:
        reads: entry key -> reads of it so far.
    """

    name = "shaky"
    locked = False

    def __init__(self, lost: Iterable[EntryKey] = (), unreadable: Iterable[EntryKey] = ()) -> None:
        self.lost, self.unreadable = set(lost), set(unreadable)
        self.reads: Counter[EntryKey] = Counter()

    def get(self, key: EntryKey) -> Lookup[Payload]:
        self.reads[key] += 1
        if key in self.unreadable:
            return Lookup.unavailable("held, but every read fails")
        self.lost.discard(key)  # evicted between the offer and this read
        return Lookup.miss()

    def contains(self, key: EntryKey) -> Status:
        return Status.HIT if key in self.lost or key in self.unreadable else Status.MISS

    def put(self, entry: Entry) -> Write:
        return Write.done()

    def drop(self, key: EntryKey) -> None:
        self.lost.discard(key)

    def peek(self, key: EntryKey) -> Lookup[Meta]:
        return Lookup.miss()


class UnreadableEntries:
    """An engine adapter's entry store (`kamera_agent.engines.shards.EntryStore`) that holds every
    entry filed in it and fails every read of one: a load that fails after its offer.

    Attributes:
        held: the keys filed.
        reads: reads so far (each answered ``None``).
    """

    def __init__(self) -> None:
        self.held: set[EntryKey] = set()
        self.reads = 0

    def contains(self, key: EntryKey) -> bool:
        return key in self.held

    def get(self, key: EntryKey) -> object:
        self.reads += 1
        return None

    def put(self, key: EntryKey, value: ChunkKV) -> object:
        self.held.add(key)
        return key


class DictSlots(KVSlots):
    """An engine's KV pool as a dict of token slots: slot -> that token's keys and values at
    every layer (``[layers, heads, dim]`` each). An adapter's load and capture logic runs over it
    without an engine; `KVSlots.write` and `KVSlots.read` relocate as they do over a real pool.

    Attributes:
        slots: slot -> (keys, values), float32 on the CPU, as written.
    """

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write_placed(self, kv: ChunkKV, slots: torch.Tensor) -> None:
        for i, slot in enumerate(slots.tolist()):
            keys, values = kv.keys[:, :, i], kv.values[:, :, i]  # [layers, heads, dim]
            self.slots[slot] = (keys.float().cpu().clone(), values.float().cpu().clone())

    def read_placed(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raises `KeyError` for a slot never written (an adapter reading a slot it did not fill)."""
        pairs = [self.slots[slot] for slot in slots.tolist()]
        keys = torch.stack([k for k, _ in pairs], dim=2)  # [layers, heads, n, dim]
        values = torch.stack([v for _, v in pairs], dim=2)
        return keys, values
