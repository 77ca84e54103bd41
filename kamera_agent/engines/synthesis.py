"""A synthesized prefix: which chunks after an engine's own prefix hit the store can serve, and their KV.

Why engine-neutral: SGLang's radix cache and vLLM's connector both ask the same question of a
request (how many tokens after the engine's own cached prefix can be loaded instead of
computed?) and both answer it by writing relocated chunk KV into the engine's slots. Only how
a request is cut into chunks and where slots live is engine-specific; this module holds the
rest: each chunk's **state** (`kamera_agent.core.identity`: what its KV encodes, chained over
the chunks before it), where the store holds that state's position-free KV, and the capture of
a prefill's KV under the states it really has.

    request chunks ──► chain states left to right ──► beyond the engine's hit: stored? serve : stop
                         (in the engine's cache: the state it was computed or loaded in)

Modes (`serve_mode_of`, from `WindowConfig`): ``"exact"`` serves a chunk only in the state a
re-prefill of the request would compute (its KV conditioned on exactly the chunks before it),
so a load changes no output; ``"keep"`` (``survivors="keep"``) also serves a chunk in the last
state it was captured in when that one is missing, the window's "survivors keep what they
absorbed": a slide or reorder is then served without recompute, approximately. Patches of rank
below full need a chunk's canonical, one forward an engine's cache hook cannot run, so only
full-rank states are served here.

A kept state is an approximation, so under a drift budget (``WindowConfig.drift_budget``, by
default the model's calibrated ε) it is served only where something vouches for it within ε
(`DriftBudget.vouch`; an engine cannot recompute tokens to audit): the model's calibration, by
what is known before any forward (whether every chunk its KV absorbed is still in the request,
and its distance from the request's first approximated chunk: `kamera_agent.fidelity.vouching`),
counting what the kept chunks to its left carry; an audit filed for that state behind the
request's left context (`DriftAudit`, measured by a window sharing the store) only raises the
estimate, and vouches alone where the calibration fitted no bounds. A model without a
calibration serves exactly, with one warning; ``drift_budget=None`` keeps unbounded. Every
served chunk carries its estimate (`Served.drift`), so a request's kept tokens and largest drift
are reported (`LoadPlan.kept_tokens`, `LoadPlan.drift`).

Every chunk key is scoped by the request's anchor, itself keyed in the request's namespace
(SGLang's ``extra_key``, vLLM's ``cache_salt``; ``""`` for neither), so every state is too: one
tenant is never served another's KV, approximate or not. A request's first chunk is its anchor
(`_RequestStates`), as a window's system block is, so an engine and a conversation window share
entries.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from kamera_agent.config import WindowConfig
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.engines.load_plan import (  # their home; imported from here too
    EngineStats,
    KeptLoad,
    Loaded,
    LoadPlan,
    RequestChunk,
    Served,
)
from kamera_agent.engines.offers import FailedEntries
from kamera_agent.engines.shards import EntryStore
from kamera_agent.fidelity import (
    AuditSource,
    Calibration,
    DriftBudget,
    ServeMode,
    engine_budget,
    filed_in,
    serve_mode_of,
)
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import EntryKey

__all__ = [
    "EngineStats",
    "KeptBudget",
    "KeptLoad",
    "LoadPlan",
    "Loaded",
    "PrefixSynthesis",
    "RequestChunk",
    "ServeMode",
    "Served",
    "serve_mode_of",
    "serving",
]


@dataclass(frozen=True)
class KeptBudget:
    """The drift budget an engine serves kept states within (`DriftBudget`: ε, the model's
    calibration, the verdict) and where audits are filed (the store every window sharing it
    files its audits in)."""

    budget: DriftBudget
    audits: AuditSource

    @property
    def epsilon(self) -> float:
        return self.budget.epsilon

    @property
    def calibration(self) -> Calibration:
        return self.budget.calibration

    @property
    def vouch_epsilon(self) -> float:
        """The ε a kept state is served within (`DriftBudget.vouch_epsilon`)."""
        return self.budget.vouch_epsilon

    def estimate(
        self, state: ChunkState, left: Context, inherited: float, distance: int, present: Collection[str]
    ) -> float | None:
        """``state``'s estimated drift behind ``left`` at ``distance`` from the request's first
        approximated chunk, in a request holding the chunk keys ``present`` (`DriftBudget.vouch`:
        from what is known without measuring), or ``None``: nothing vouches for it."""
        return self.budget.vouch(state, left, inherited, filed_in(self.audits), distance, present)


def serving(
    config: WindowConfig, audits: AuditSource, fingerprint: str
) -> tuple[ServeMode, KeptBudget | None]:
    """The mode an engine serves in under ``config`` and the drift budget its kept states stay within
    (`kamera_agent.fidelity.engine_budget`), with where audits are filed."""
    mode, budget = engine_budget(config, fingerprint)
    return mode, None if budget is None else KeptBudget(budget, audits)


@dataclass
class PrefixSynthesis:
    """Chunk states of requests over one store, and the KV that serves them.

    One instance per engine process: it remembers the states it loaded into the engine's cache
    where they differ from what a forward computes (a later request finding them in the engine's
    own prefix must chain those, not a re-prefill's) and, under ``"keep"``, the last state each
    chunk was captured in.

    Both memories are bounded (`MEMORY`, least recently used forgotten first): a server runs
    for weeks. A forgotten load makes a later request take that chunk's state for a computed one,
    which only ``"keep"`` ever stores (an approximation filed under a slightly wrong name). An
    engine that evicts a loaded chunk's tokens says so (`lost`): its tokens computed again are
    what a forward gives. A third memory, `failed`, holds the entries whose load failed: neither
    offered nor taken as stored (a capture files them anew) until the store has them afresh
    (`kamera_agent.engines.offers`).

    Args:
        store: where position-free chunk KV is kept (shared by every process that names it): a
            `ChunkStore`, or a `ShardedStore` where the engine splits KV over ranks.
        mode: ``"exact"`` or ``"keep"`` (`serve_mode_of`).
        budget: under ``"keep"``, the drift budget kept states are served within (`serving`);
            ``None``: unbounded.
    """

    store: EntryStore
    mode: ServeMode = "exact"
    budget: KeptBudget | None = None
    failed: FailedEntries = field(default_factory=FailedEntries)
    _latest: OrderedDict[str, Served] = field(default_factory=OrderedDict, repr=False)
    _loaded: OrderedDict[str, KeptLoad] = field(default_factory=OrderedDict, repr=False)

    # -- planning ---------------------------------------------------------------------------
    def plan(
        self,
        namespace: str,
        chunks: Sequence[RequestChunk],
        device_len: int,
        limit: int,
        page_size: int = 1,
        *,
        approximate: bool = True,
    ) -> LoadPlan:
        """The longest run of chunks after ``device_len`` the store can serve, cut at ``limit``
        tokens and aligned down to ``page_size``; ``approximate=False`` serves only what a
        re-prefill computes whatever the mode (an engine's unsalted requests, whose cached
        blocks every other request may reuse). Reads presence only: no side effects."""
        served: list[Served] = []
        chain, prefix = _RequestStates(), _prefix_root(namespace)
        worst: float | None = 0.0  # the largest drift to the left (None: unknown)
        held_kept = 0  # tokens of the engine's own hit in kept states, and their largest drift:
        held_drift: float | None = 0.0
        refused = False
        present = {chunk.key for chunk in chunks}
        approximated_from: int | None = None  # the first chunk held or served in a kept state
        for index, chunk in enumerate(chunks):
            if chunk.start >= limit:
                break
            prefix = _hash(prefix, chunk.key)
            computed = chain.computed(chunk)
            held = computed
            if chunk.start < device_len:
                held = self._held(prefix, computed, min(device_len, chunk.end) - chunk.start)
                if held.digest != computed.digest:  # an earlier load's kept state, in the engine's cache
                    held_kept += min(device_len, chunk.end) - chunk.start
                    record = self._loaded.get(prefix)
                    drift = record.drift if record is not None else None
                    worst = None if worst is None or drift is None else max(worst, drift)
                    held_drift = None if held_drift is None or drift is None else max(held_drift, drift)
            if chunk.end <= device_len:
                chain.extend(chunk, held)
                approximated_from = _first_approximated(approximated_from, index, chain)
                continue
            distance = 0 if approximated_from is None else index - approximated_from
            hit, refused = self._servable(
                namespace, chunk, held, computed, device_len, approximate, chain, worst, (distance, present)
            )
            if hit is None:
                break
            served.append(hit)
            worst = None if worst is None or hit.drift is None else max(worst, hit.drift)
            chain.extend(chunk, hit.state)
            approximated_from = _first_approximated(approximated_from, index, chain)
        end = min(served[-1].chunk.end if served else device_len, limit)
        end = max(device_len, end - end % page_size)
        while served and served[-1].chunk.start + served[-1].skip >= end:
            served.pop()
        return LoadPlan(
            device_len, end if served else device_len, tuple(served), held_kept, held_drift, refused
        )

    def load(self, plan: LoadPlan) -> Loaded:
        """The served chunks' whole position-free KV, or none and every entry that could not be
        read (a load is all or nothing: the engine then computes the tokens; each entry is read,
        so that one failed load finds every entry the store lost). Those are not offered again
        until filed anew (`failed`); the others are fine."""
        out: list[ChunkKV] = []
        failed: list[EntryKey] = []
        for item in plan.served:
            kv = self.read(item.entry)
            if kv is None or kv.num_tokens != len(item.chunk):
                failed.append(item.entry)
            else:
                out.append(kv)
        self.failed.failed(failed)
        self.failed.loaded(item.entry for item in plan.served if item.entry not in failed)
        return Loaded(() if failed else tuple(out), tuple(failed))

    def loaded(self, namespace: str, chunks: Sequence[RequestChunk], plan: LoadPlan) -> list[KeptLoad]:
        """Record what a load put into the engine's cache, so later requests that find these
        tokens in the engine's own prefix chain the states they really hold: a kept state, or
        a splice (a chunk the load's end cuts, finished by a forward over a kept head). Returns
        the records made: an engine that evicts their tokens tells `lost`."""
        if self.mode == "exact":
            return []  # every state served is the one a forward computes: nothing to remember
        served = {item.chunk.start: item for item in plan.served}
        prefix = _prefix_root(namespace)
        out: list[KeptLoad] = []
        for chunk in chunks:
            if chunk.start >= plan.end:
                break
            prefix = _hash(prefix, chunk.key)
            item = served.get(chunk.start)
            if item is None:
                continue
            if item.computed or item.computed_state is None:
                self._loaded.pop(prefix, None)  # a forward's state now, whatever a load left before
                continue
            tokens = min(chunk.end, plan.end) - chunk.start
            out.append(KeptLoad(prefix, chunk, item.state, item.computed_state, tokens, item.drift))
            _remember(self._loaded, prefix, out[-1])
        return out

    def lost(self, prefix: str, kept_tokens: int) -> None:
        """The engine lost the tokens of the load recorded at ``prefix`` (`KeptLoad.prefix`) from
        its ``kept_tokens``-th on (it evicted them): forget the load, or hold it for the tokens that
        remain (a forward computes what follows them again)."""
        record = self._loaded.get(prefix)
        if record is None:
            return
        if kept_tokens <= 0:
            del self._loaded[prefix]
        elif kept_tokens < record.tokens:
            self._loaded[prefix] = replace(record, tokens=kept_tokens)

    @property
    def kept_loads(self) -> tuple[KeptLoad, ...]:
        """The loads remembered, least recently made first."""
        return tuple(self._loaded.values())

    # -- capture ----------------------------------------------------------------------------
    def captures(
        self, namespace: str, chunks: Sequence[RequestChunk], upto: int
    ) -> list[tuple[RequestChunk, ChunkState, EntryKey]]:
        """Every chunk within ``tokens[:upto]`` (what the engine holds after a prefill) with the
        state it holds and the entry its KV belongs in, where the store does not hold it yet.
        Under ``"keep"`` this also makes each chunk's state its latest."""
        out: list[tuple[RequestChunk, ChunkState, EntryKey]] = []
        chain, prefix = _RequestStates(), _prefix_root(namespace)
        for chunk in chunks:
            if chunk.end > upto:
                break
            prefix = _hash(prefix, chunk.key)
            state = self._held(prefix, chain.computed(chunk), len(chunk))
            chain.extend(chunk, state)
            entry = _entry(chunk, state)
            if self.mode == "keep":
                _remember(self._latest, _latest_key(namespace, chunk), Served(chunk, state, entry))
            if self.failed.blocked(entry) or not self.store.contains(entry):
                out.append((chunk, state, entry))  # (a blocked entry's load failed: filed anew)
        return out

    def capture(
        self,
        namespace: str,
        chunks: Sequence[RequestChunk],
        upto: int,
        read: Callable[[RequestChunk], ChunkKV],
    ) -> int:
        """Store what `captures` names; ``read`` gives a chunk's KV from the engine's cache,
        position-free. Returns how many entries were stored."""
        found = self.captures(namespace, chunks, upto)
        for chunk, _, entry in found:
            self.write(entry, read(chunk))
        return len(found)

    # -- the store's side ------------------------------------------------------------------
    def read(self, entry: EntryKey) -> ChunkKV | None:
        """The position-free KV filed at ``entry`` (a canonical, or a full state's KV), or ``None``."""
        kv = self.store.get(entry)
        return kv if isinstance(kv, ChunkKV) else None

    def write(self, entry: EntryKey, kv: ChunkKV) -> None:
        """File position-free ``kv`` (read from the engine's cache) at ``entry`` (anew, where its
        load had failed)."""
        self.store.put(entry, replace(kv, chunk_key=entry.key))
        self.failed.refiled([entry])

    def _stored(self, entry: EntryKey) -> bool:
        """Whether ``entry`` may be offered: the store holds it and no load of it failed since
        it was last filed."""
        return not self.failed.blocked(entry) and self.store.contains(entry)

    def _behind(self, worst: float | None) -> float | None:
        """The drift of a forward's state behind chunks whose largest drift is ``worst``: what it
        inherits (`Calibration.estimate` of no audit error), 0 behind exact chunks, ``None``
        where that is unknown."""
        if worst == 0.0:
            return 0.0
        if worst is None or self.budget is None:
            return None
        return self.budget.calibration.estimate(0.0, worst)

    # -- states -----------------------------------------------------------------------------
    def _held(self, prefix: str, computed: ChunkState, tokens: int) -> ChunkState:
        """The state of a chunk's first ``tokens`` the engine holds: the one a load left there,
        else ``computed``."""
        record = self._loaded.get(prefix) if self._loaded else None
        return computed if record is None else record.held(tokens)

    def _servable(
        self,
        namespace: str,
        chunk: RequestChunk,
        held: ChunkState,
        computed: ChunkState,
        device_len: int,
        approximate: bool,
        chain: _RequestStates,
        worst: float | None,
        where: tuple[int, Collection[str]],
    ) -> tuple[Served | None, bool]:
        """The chunk served from the store: in the state the engine's part of it holds (or, past
        the engine's hit, a forward would compute), else under ``"keep"`` in its last captured
        state (spliced behind the engine's part of the chunk, if any), where something vouches
        for it behind ``chain``'s context within the budget (`KeptBudget.estimate`), counting
        ``worst``, the largest drift to its left, at ``where``: its distance from the request's
        first approximated chunk and the chunk keys in the request. With it, whether a kept
        state was refused."""
        skip = max(0, device_len - chunk.start)
        entry = _entry(chunk, held)
        if self._stored(entry):
            return Served(chunk, held, entry, skip, computed, self._behind(worst)), False
        if self.mode == "keep" and approximate:
            latest = self._latest.get(_latest_key(namespace, chunk))
            if latest is not None and self._stored(latest.entry):
                drift = None
                if self.budget is not None:
                    left = chain.context or Context.root("")
                    drift = None if worst is None else self.budget.estimate(latest.state, left, worst, *where)
                    if drift is None or not drift <= self.budget.vouch_epsilon:  # NaN: not within it
                        return None, True
                state = latest.state if skip == 0 else ChunkState.spliced(held, latest.state, skip)
                return Served(chunk, state, latest.entry, skip, computed, drift), False
        return None, False


MEMORY = 1 << 16
"""Most loads and latest states a `PrefixSynthesis` remembers (each a few hundred bytes)."""

_V = TypeVar("_V")


def _remember(memory: OrderedDict[str, _V], key: str, value: _V) -> None:
    memory[key] = value
    memory.move_to_end(key)
    while len(memory) > MEMORY:
        memory.popitem(last=False)


class _RequestStates:
    """The states a forward gives a request's chunks, left to right, as a window's are chained.

    The first chunk is the anchor: its KV is computed behind nothing and every later chunk's
    behind it (`Context.root` of its key, which `token_key` also scopes the later chunks' keys
    by), so the chunk right after it is in its canonical state, as a window's first chunk is,
    and the rest are conditioned on the states before them. A window and an engine holding the
    same conversation then name the same states and find each other's entries.
    """

    _NOTHING = Context.root("")

    def __init__(self) -> None:
        self.context: Context | None = None

    def computed(self, chunk: RequestChunk) -> ChunkState:
        """The state a forward over the chunks before it (in their held states) gives ``chunk``."""
        if self.context is None:
            return ChunkState.canonical(chunk.key, self._NOTHING)
        return ChunkState.patched(chunk.key, "full", self.context)

    def extend(self, chunk: RequestChunk, state: ChunkState) -> None:
        """``chunk`` is held in ``state``: the chunks after it are conditioned on that."""
        self.context = Context.root(chunk.key) if self.context is None else self.context.extend(state)


def _first_approximated(found: int | None, index: int, chain: _RequestStates) -> int | None:
    """The index of the request's first chunk held in a state a re-prefill would not compute:
    ``found`` if known, else ``index`` where the chain stopped being exact with it."""
    if found is None and chain.context is not None and not chain.context.exact:
        return index
    return found


def _entry(chunk: RequestChunk, state: ChunkState) -> EntryKey:
    if state.kind == "canonical":
        return EntryKey.canonical(chunk.key)
    return EntryKey.full(chunk.key, state.digest)


def _latest_key(namespace: str, chunk: RequestChunk) -> str:
    return f"{namespace}\x1f{chunk.key}"


def _prefix_root(namespace: str) -> str:
    return _hash("prefix", namespace)


def _hash(*parts: str) -> str:
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).hexdigest()
