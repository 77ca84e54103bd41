"""A synthesized prefix: which chunks after an engine's own prefix hit the store can serve, and their KV.

Why engine-neutral: SGLang's radix cache and vLLM's connector both ask the same question of a
request (how many tokens after the engine's own cached prefix can be loaded instead of
computed?) and both answer it by writing relocated chunk KV into the engine's slots. Only how
a request is cut into chunks and where slots live is engine-specific; this module holds the
rest: each chunk's **state** (`kamera_agent.core.identity`: what its KV encodes, chained over
the chunks before it), where the store keeps that state's position-free KV, and the capture of
a prefill's KV under the states it really has.

    request chunks ──► chain states left to right ──► beyond the engine's hit: stored? serve : stop
                         (in the engine's cache: the state it was computed or loaded in)

Policies (`policy_of`, from `WindowConfig`): ``"exact"`` serves a chunk only in the state a
re-prefill of the request would compute (its KV conditioned on exactly the chunks before it),
so a load changes no output; ``"keep"`` (``survivors="keep"``) also serves a chunk in the last
state it was captured in when that one is missing, the window's "survivors keep what they
absorbed": a slide or reorder is then served without recompute, approximately. Patches of rank
below full need a chunk's canonical, one forward an engine's cache hook cannot run, so only
full-rank states are served here.

Every state and chunk key is scoped by the request's namespace (SGLang's ``extra_key``, vLLM's
``cache_salt``): one tenant is never served another's KV, approximate or not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from kamera_agent.config import WindowConfig
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import ChunkStore, EntryKey

__all__ = ["Plan", "PrefixSynthesis", "RequestChunk", "ServePolicy", "Served", "chunk_key", "policy_of"]

ServePolicy = Literal["exact", "keep"]


def policy_of(config: WindowConfig) -> ServePolicy:
    """What an engine may serve under ``config``: kept states only where survivors keep them."""
    return "keep" if config.survivors == "keep" else "exact"


def chunk_key(namespace: str, kind: str, tokens: Sequence[int]) -> str:
    """A request chunk's content key: its token ids (an image's are its content-derived pad
    values) in its namespace."""
    digest = hashlib.sha256(f"engine-chunk\x1f{namespace}\x1f{kind}\x1f".encode())
    digest.update(",".join(map(str, tokens)).encode())
    return digest.hexdigest()


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
        skip: leading tokens of the chunk the engine already holds (its prefix hit ends inside
            the chunk); the load writes the rest.
        computed: the state is the one a forward over the states before it computes (a load
            of part of the chunk then agrees with a computed remainder).
    """

    chunk: RequestChunk
    state: ChunkState
    entry: EntryKey
    skip: int = 0
    computed: bool = True


@dataclass(frozen=True)
class Plan:
    """What a synthesis of one request loads: ``tokens[device_len:end]``, from ``served``.

    Attributes:
        device_len: tokens the engine's own cache holds (its prefix hit).
        end: where the synthesized prefix ends (page-aligned; ``device_len`` when nothing is served).
        served: the chunks whose KV is loaded, left to right (the first may start inside the
            engine's hit, the last may be cut by ``end``).
    """

    device_len: int
    end: int
    served: tuple[Served, ...] = ()

    @property
    def tokens(self) -> int:
        """How many tokens the synthesis loads."""
        return self.end - self.device_len


_UNKNOWN = "unknown"


@dataclass
class PrefixSynthesis:
    """Chunk states of requests over one store, and the KV that serves them.

    One instance per engine process: it remembers which kept states it loaded into the
    engine's cache (a later request finding them in the engine's own prefix must chain them,
    not the states a re-prefill would compute) and, under ``"keep"``, the last state each chunk
    was captured in.

    Args:
        store: where position-free chunk KV is kept (shared by every process that names it).
        policy: ``"exact"`` or ``"keep"`` (`policy_of`).
    """

    store: ChunkStore
    policy: ServePolicy = "exact"
    _latest: dict[str, Served] = field(default_factory=dict, repr=False)
    _loaded: dict[str, str] = field(default_factory=dict, repr=False)
    _known: dict[str, ChunkState] = field(default_factory=dict, repr=False)

    # -- planning ---------------------------------------------------------------------------
    def plan(
        self, namespace: str, chunks: Sequence[RequestChunk], device_len: int, limit: int, page_size: int = 1
    ) -> Plan:
        """The longest run of chunks after ``device_len`` the store can serve, cut at ``limit``
        tokens and aligned down to ``page_size``. Reads presence only: no side effects."""
        served: list[Served] = []
        context, prefix = _root(namespace), _prefix_root(namespace)
        for chunk in chunks:
            if chunk.start >= limit:
                break
            prefix = _hash(prefix, chunk.key)
            computed = ChunkState.patched(chunk.key, "full", context)
            held = self._held(prefix, computed) if chunk.start < device_len else computed
            if held is None:
                break  # the engine holds KV whose state has no name: nothing after it can be chained
            if chunk.end <= device_len:
                context = context.extend(held)
                continue
            hit = self._servable(namespace, chunk, held, computed, device_len)
            if hit is None:
                break
            served.append(hit)
            context = context.extend(hit.state)
        end = min(served[-1].chunk.end if served else device_len, limit)
        end = max(device_len, end - end % page_size)
        while served and served[-1].chunk.start + served[-1].skip >= end:
            served.pop()
        return Plan(device_len, end if served else device_len, tuple(served))

    def load(self, plan: Plan) -> list[ChunkKV] | None:
        """The served chunks' whole position-free KV, or ``None`` when any entry is gone (a load
        is all or nothing: the engine then computes the tokens)."""
        out: list[ChunkKV] = []
        for item in plan.served:
            kv = (
                self.store.get_canonical(item.entry.key)
                if item.entry.kind == "canonical"
                else self.store.get_full(item.entry.key, item.entry.variant)
            )
            if kv is None or kv.num_tokens != len(item.chunk):
                return None
            out.append(kv)
        return out

    def loaded(self, namespace: str, chunks: Sequence[RequestChunk], plan: Plan) -> None:
        """Record what a load put into the engine's cache, so later requests that find these
        tokens in the engine's own prefix know the states they hold (a kept state is not the
        one a re-prefill computes). A chunk cut by the load's end and finished by a forward
        holds a mix no state names, unless its state is the computed one."""
        if self.policy == "exact":
            return  # every state served is the one a re-prefill computes: nothing to remember
        served = {item.chunk.start: item for item in plan.served}
        prefix = _prefix_root(namespace)
        for chunk in chunks:
            if chunk.start >= plan.end:
                break
            prefix = _hash(prefix, chunk.key)
            item = served.get(chunk.start)
            if item is not None:
                whole = chunk.end <= plan.end or item.computed
                self._loaded[prefix] = item.state.digest if whole else _UNKNOWN
                self._known[item.state.digest] = item.state

    # -- capture ----------------------------------------------------------------------------
    def capture(
        self,
        namespace: str,
        chunks: Sequence[RequestChunk],
        upto: int,
        read: Callable[[RequestChunk], ChunkKV],
    ) -> int:
        """Store the position-free KV of every chunk within ``tokens[:upto]`` (what the engine
        holds after a prefill) whose state is named and not stored yet; ``read`` gives a chunk's
        KV from the engine's cache, position-free. Returns how many entries were stored."""
        stored = 0
        context, prefix = _root(namespace), _prefix_root(namespace)
        for chunk in chunks:
            if chunk.end > upto:
                break
            prefix = _hash(prefix, chunk.key)
            state = self._held(prefix, ChunkState.patched(chunk.key, "full", context))
            if state is None:
                break
            context = context.extend(state)
            entry = _entry(chunk, state)
            if self.policy == "keep":
                self._latest[_latest_key(namespace, chunk)] = Served(chunk, state, entry)
            if self.store.contains(entry):
                continue
            kv = replace(read(chunk), chunk_key=chunk.key)
            if entry.kind == "canonical":
                self.store.put_canonical(kv)
            else:
                self.store.put_full(kv, state.digest)
            stored += 1
        return stored

    # -- states -----------------------------------------------------------------------------
    def _held(self, prefix: str, computed: ChunkState) -> ChunkState | None:
        """The state of a chunk the engine holds: the one it was loaded in, else ``computed``;
        ``None`` for a load that left no nameable state."""
        loaded = self._loaded.get(prefix) if self._loaded else None
        if loaded is None:
            return computed
        return None if loaded == _UNKNOWN else self._known.get(loaded)

    def _servable(
        self, namespace: str, chunk: RequestChunk, held: ChunkState, computed: ChunkState, device_len: int
    ) -> Served | None:
        skip = max(0, device_len - chunk.start)
        entry = _entry(chunk, held)
        if self.store.contains(entry):
            return Served(chunk, held, entry, skip, held.digest == computed.digest)
        if self.policy == "keep" and skip == 0:  # a kept state never finishes a chunk begun in another
            kept = self._latest.get(_latest_key(namespace, chunk))
            if kept is not None and self.store.contains(kept.entry):
                return Served(chunk, kept.state, kept.entry, 0, kept.state.digest == computed.digest)
        return None


def _root(namespace: str) -> Context:
    return Context.root(f"engine|{namespace}")


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
