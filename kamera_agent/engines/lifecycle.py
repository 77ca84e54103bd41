"""A request's life inside a serving engine, in the one place every engine adapter uses.

Why: an adapter differs from another only in the engine's hooks (where the engine matches a
prefix, gives a request slots, runs a forward, ends a request) and in how its KV sits in memory
(`kamera_agent.engines.slots`). What kamera does at each step of a request's life is the same in
every engine (vLLM's connector, SGLang's radix cache, an engine added later), so it is here:

    the engine's request ──► `EngineRequest`: its namespace (`namespace_of`) and chunks
        │ the engine's own prefix hit ends at ``device_len``
        ▼
    `EngineRequest.plan` ── the longest run of chunks past it the store serves (`PrefixSynthesis`)
        │ the engine gives the planned tokens slots
        ▼
    `count_offer` ──► each `LoadSpan` written into them (`count_written`)
                 └──► an entry gone or unreadable (`count_unloadable`: a fault of its own kind;
                      the engine computes the tokens, the entry is offered to no request until
                      filed anew: `kamera_agent.engines.offers`)
        │ a forward computes the rest
        ▼
    `EngineRequest.captures` ── the chunks it formed that the store lacks, and their entries
        │ the request ends
        ▼
    `ServedReport` ── prompt tokens loaded, tokens in kept states, their largest drift, a refusal

docs/engines.md ("Adding an engine") says how an adapter for another engine calls these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from kamera_agent.core.identity import ChunkState
from kamera_agent.engines.faults import HookFaults
from kamera_agent.engines.load_plan import EngineStats, KeptLoad, LoadPlan, RequestChunk, Served
from kamera_agent.engines.shards import EntryStore
from kamera_agent.engines.synthesis import PrefixSynthesis
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import EntryKey

__all__ = [
    "EngineRequest",
    "LoadSpan",
    "ServedReport",
    "count_offer",
    "count_unloadable",
    "count_written",
    "load_spans",
    "namespace_of",
]


Capture = tuple[RequestChunk, ChunkState, EntryKey]
"""A chunk a forward formed that the store lacks: the chunk, the state it holds, its entry."""


def namespace_of(scope: str, salt: str) -> str:
    """A request's tenant: the engine's own scope of its cache (vLLM's LoRA name, SGLang's
    ``extra_key``) and the client's salt (``cache_salt``); ``""`` for neither, the namespace a
    window's chunks are in, so a window and an engine share entries."""
    return f"{scope}|{salt}" if scope or salt else ""


@dataclass(frozen=True)
class EngineRequest:
    """A request as kamera plans it in any engine.

    Attributes:
        namespace: its tenant (`namespace_of`): every chunk key and state is scoped by it.
        chunks: its prompt cut into chunks, left to right (`kamera_agent.engines.chunking`).
        salted: the client chose a salt, so approximations may be served to it (`plan`).
    """

    namespace: str
    chunks: Sequence[RequestChunk]
    salted: bool = False

    def plan(self, synthesis: PrefixSynthesis, device_len: int, limit: int, page_size: int = 1) -> LoadPlan:
        """The longest run of its chunks past the engine's own hit (``device_len``) the store can
        serve, cut at ``limit`` tokens and aligned down to ``page_size``. Approximate states only
        under a salt: what a load writes enters the engine's prefix cache as if computed, where
        every later request of the namespace may match it, so an approximation stays under a salt
        its clients chose. Reads presence only: a dry run."""
        return synthesis.plan(
            self.namespace, self.chunks, device_len, limit, page_size, approximate=self.salted
        )

    def captures(self, synthesis: PrefixSynthesis, upto: int) -> list[Capture]:
        """The chunks within its first ``upto`` tokens (what a forward formed) that the store
        lacks, each with the state it holds and the entry its KV belongs in."""
        return synthesis.captures(self.namespace, self.chunks, upto)

    def capture(self, synthesis: PrefixSynthesis, upto: int, read: Callable[[RequestChunk], ChunkKV]) -> int:
        """File what `captures` names, ``read`` giving a chunk's position-free KV from the engine's
        cache; how many entries were filed."""
        return synthesis.capture(self.namespace, self.chunks, upto, read)

    def loaded(self, synthesis: PrefixSynthesis, plan: LoadPlan) -> list[KeptLoad]:
        """Record that ``plan``'s loads are in the engine's cache (once every one was written), so
        later requests finding them in the engine's own prefix chain the states they hold."""
        return synthesis.loaded(self.namespace, self.chunks, plan)


@dataclass(frozen=True)
class LoadSpan:
    """What a load writes of one served chunk: request tokens ``start..end``, which are
    ``kv[entry_from:entry_to]`` of the chunk's entry (the engine's hit may end inside the
    chunk, the plan's end may cut it)."""

    served: Served
    start: int
    end: int

    @property
    def entry_from(self) -> int:
        """The first row of the chunk's entry written (``start`` in the entry's own rows)."""
        return self.start - self.served.chunk.start

    @property
    def entry_to(self) -> int:
        """The row of the chunk's entry the write stops before (``end`` in the entry's rows)."""
        return self.end - self.served.chunk.start


def load_spans(plan: LoadPlan) -> list[LoadSpan]:
    """The spans ``plan`` writes, left to right: ``tokens[device_len:end]`` exactly."""
    return [
        LoadSpan(item, max(item.chunk.start, plan.device_len), min(item.chunk.end, plan.end))
        for item in plan.served
    ]


def count_offer(stats: EngineStats, plan: LoadPlan) -> None:
    """The engine gave ``plan``'s tokens slots: one request offered, its tokens, its kept ones."""
    stats.offered += 1
    stats.tokens_offered += plan.tokens
    stats.tokens_kept += plan.kept_tokens


def count_written(stats: EngineStats, tokens: int, chunks: int = 1) -> None:
    """One load written into the engine's cache: ``tokens`` tokens of ``chunks`` chunk pieces."""
    stats.loads += 1
    stats.chunks_loaded += chunks
    stats.tokens_loaded += tokens


def count_unloadable(
    faults: HookFaults, store: EntryStore, hook: str, rid: str, entries: Iterable[EntryKey]
) -> None:
    """A load at ``hook`` found offered ``entries`` gone (``LostEntry``) or held but unreadable
    (``UnreadableEntry``): each a fault of its own kind, counted and logged once per kind."""
    for entry in entries:
        kind = "UnreadableEntry" if store.contains(entry) else "LostEntry"
        faults.count(hook, kind, f"request {rid}: {entry} could not be read")


@dataclass(frozen=True)
class ServedReport:
    """What kamera served one request, for its client.

    Attributes:
        loaded_tokens: prompt tokens loaded from the store.
        kept_tokens: tokens in kept states (approximations), loaded now or left in the engine's
            prefix cache by an earlier load.
        drift: their largest estimated drift (0: exact; ``None``: unknown, kept unbounded).
        kept_refused: a kept state was refused: nothing vouched for it within the drift budget.
    """

    loaded_tokens: int = 0
    kept_tokens: int = 0
    drift: float | None = 0.0
    kept_refused: bool = False

    @classmethod
    def of(cls, plan: LoadPlan | None, failed: bool = False) -> ServedReport:
        """The report of ``plan`` (``None``: nothing planned). A load that ``failed`` loaded
        nothing (the engine computed those tokens): only what the engine's cache held counts."""
        if plan is None:
            return cls()
        if failed:
            plan = replace(plan, end=plan.device_len, served=())
        return cls(plan.tokens, plan.kept_tokens + plan.held_kept, plan.drift, plan.refused)

    def as_dict(self) -> dict[str, Any]:
        """The report's fields by name (what vLLM returns in a request's ``kv_transfer_params``)."""
        return asdict(self)

    def describe(self) -> str:
        """The report as one line of a log (an engine whose outputs carry no field for it)."""
        drift = "unknown" if self.drift is None else f"{self.drift:.3g}"
        refused = "; a kept state was refused (no audit within the drift budget)" if self.kept_refused else ""
        return (
            f"loaded {self.loaded_tokens} prompt tokens, {self.kept_tokens} kept (approximate), "
            f"largest drift {drift}{refused}"
        )
