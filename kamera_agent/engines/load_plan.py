"""What a synthesized prefix answers about a request: its chunks, each one served, the plan of a
load and its outcome, the kept loads, and what an engine adapter counted.

Why apart from `kamera_agent.engines.synthesis`: the engine adapters (their scheduler and worker
halves, the lifecycle both share, SGLang's cache) pass these results between them without
planning anything; the synthesis is the one place that makes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kamera_agent.core.identity import ChunkState
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import EntryKey

__all__ = ["EngineStats", "KeptLoad", "LoadPlan", "Loaded", "RequestChunk", "Served"]


@dataclass
class EngineStats:
    """What an engine adapter did since it was built (``/metrics`` material; an engine that splits
    the work over a scheduler and a worker counts each part where it happens).

    Attributes:
        offered: requests whose tokens the store offered (the engine allocated slots for them).
        tokens_offered: tokens offered.
        loads: loads written into the engine's cache.
        tokens_loaded: tokens written from the store.
        chunks_loaded: chunk pieces written.
        failed: loads or pieces given up (an entry gone or damaged, no free slots, a layout the
            adapter cannot write): the engine computed those tokens itself.
        chunks_captured: chunk states stored from the engine's prefills.
        tokens_kept: tokens offered in kept states (approximations).
        kept_refused: plannings stopped at a kept state nothing vouched for within the drift
            budget (the engine computed it and what follows; vLLM counts each request once).
    """

    offered: int = 0
    tokens_offered: int = 0
    loads: int = 0
    tokens_loaded: int = 0
    chunks_loaded: int = 0
    failed: int = 0
    chunks_captured: int = 0
    tokens_kept: int = 0
    kept_refused: int = 0


@dataclass(frozen=True)
class RequestChunk:
    """``tokens[start:end]`` of a request as one chunk, with its content key."""

    start: int
    end: int
    key: str

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Served:
    """One chunk the store serves: the state it is served in and where that state's KV is.

    Attributes:
        state: what the chunk holds once loaded (a kept state finishing a chunk the engine's hit
            began in another state is a spliced one).
        entry: the stored KV written.
        skip: leading tokens of the chunk the engine already holds (its prefix hit ends inside
            the chunk); the load writes the rest.
        computed_state: the state a forward over the states before it would give the chunk.
        drift: its estimated drift against a re-prefill of the request: 0 for a forward's state
            behind exact chunks; ``None`` where unknown (kept unbounded, or behind such a chunk).
    """

    chunk: RequestChunk
    state: ChunkState
    entry: EntryKey
    skip: int = 0
    computed_state: ChunkState | None = None
    drift: float | None = 0.0

    @property
    def computed(self) -> bool:
        """Served as a forward would compute it (so a computed remainder agrees with the load)."""
        return self.computed_state is None or self.state.digest == self.computed_state.digest


@dataclass(frozen=True)
class LoadPlan:
    """What a synthesis of one request loads: ``tokens[device_len:end]``, from ``served``.

    Attributes:
        device_len: tokens the engine's own cache holds (its prefix hit).
        end: where the synthesized prefix ends (page-aligned; ``device_len`` when nothing is served).
        served: the chunks whose KV is loaded, left to right (the first may start inside the
            engine's hit, the last may be cut by ``end``).
        held_kept: tokens of the engine's own hit in kept states an earlier load left there
            (the engine's prefix cache serves them as computed).
        held_drift: their largest estimated drift (0: none held; ``None``: unknown).
        refused: the synthesis stopped at a kept state nothing vouched for within the budget
            (the engine computes it and what follows).
    """

    device_len: int
    end: int
    served: tuple[Served, ...] = ()
    held_kept: int = 0
    held_drift: float | None = 0.0
    refused: bool = False

    @property
    def tokens(self) -> int:
        """How many tokens the synthesis loads."""
        return self.end - self.device_len

    @property
    def kept_tokens(self) -> int:
        """Tokens loaded in states a forward would not give them (kept or spliced: approximations)."""
        approximate = [item for item in self.served if not item.computed]
        return sum(min(item.chunk.end, self.end) - item.chunk.start - item.skip for item in approximate)

    @property
    def drift(self) -> float | None:
        """The largest estimated drift of what the request is served, from the engine's own hit
        and from the store (0: exact; ``None``: unknown somewhere)."""
        drifts = [self.held_drift, *(item.drift for item in self.served)]
        if any(d is None for d in drifts):
            return None
        return max((d for d in drifts if d is not None), default=0.0)


@dataclass(frozen=True)
class Loaded:
    """What `PrefixSynthesis.load` read: every served chunk's whole position-free KV, or nothing
    and the entries that could not be read (gone, or unreadable: the engine computes the tokens)."""

    kvs: tuple[ChunkKV, ...] = ()
    failed: tuple[EntryKey, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass(frozen=True)
class KeptLoad:
    """A chunk a load left in the engine's cache in a state a forward would not give it (a kept
    state, or a splice): what a later request finding it in the engine's own prefix must chain.

    Attributes:
        prefix: where it is remembered (its key chained over every chunk before it, in the
            request's namespace): what `PrefixSynthesis.lost` names.
        chunk: the request's chunk.
        state: what the load wrote.
        computed: the state a forward over the chunks before it gives the chunk.
        tokens: the chunk's leading tokens that hold ``state``'s KV: the whole chunk, or fewer
            where the load's end cut it or the engine evicted the rest (what the engine holds
            after them, a forward computed behind them).
        drift: its estimated drift when loaded (``None``: unknown).
    """

    prefix: str
    chunk: RequestChunk
    state: ChunkState
    computed: ChunkState
    tokens: int
    drift: float | None = None

    def held(self, tokens: int) -> ChunkState:
        """The state of the chunk's first ``tokens`` as the engine holds them."""
        if tokens <= self.tokens:
            return self.state
        return ChunkState.spliced(self.state, self.computed, self.tokens)
