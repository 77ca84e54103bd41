"""What a chunk's KV encodes, as a chained digest: the identity patches are stored and found by.

Why chained: a chunk's KV depends on the KV of its antecedents, not only on their content. A
chunk that survived a slide still encodes the chunk that left; a patch formed over it is a
patch over *that*, and filing it under its antecedents' content keys let another window (or
this one, later) serve it where the antecedent encodes something else. So a chunk's **state**
names exactly what its KV is, the way a prefix cache chains block hashes (nano-vllm's
``compute_hash(token_ids, prefix)``): the content key, how it is patched, and the states of its
antecedents in order, folded one at a time into a `Context`:

    root          = H("root", anchor key)                     what every window starts behind
    context + s   = H(context, s)                             one antecedent more, O(1)
    canonical(B)  = H("canonical", key(B), root)              KV(B | ∅): exact wherever B is first
    patched(B|c)  = H("patched", key(B), rank, c)             canonical + rank-m patch of B over c
    orbit(B)      = H("orbit", key(B), rank, set, members...) mean over orderings of one set
    spliced(B)    = H("spliced", head, tail, cut)             B's first cut tokens in one state,
                                                              the rest in another (engines only)
    recomputed(B) = H("recomputed", s, c, share)              state s with its most deviating
                                                              share of tokens recomputed over c
                  = H("recomputed-head", s, c, share)         ... its first share of tokens

A state's digest determines its KV (up to relocation, which is exact): states that differ in
anything their KV depends on (an approximate antecedent, a rank, an orbit's members) differ, so
a stored patch is only ever served where its antecedents are what it was formed over. A rank
at or above a chunk's full rank is recorded as ``"full"`` (the patch is then lossless).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Literal

__all__ = [
    "ChunkState",
    "Context",
    "StateKind",
    "StateRank",
    "effective_rank",
    "orbit_digest",
    "orbit_key",
    "patched_digest",
]

StateKind = Literal["canonical", "patched", "orbit", "spliced", "recomputed"]
StateRank = int | Literal["full"]


def _hash(*parts: str) -> str:
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).hexdigest()


_MASK = (1 << 128) - 1


@functools.lru_cache(maxsize=1 << 14)
def _key_hash(chunk_key: str) -> int:
    """128 bits of a content key (itself a sha256 hex digest), for order-free set fingerprints."""
    try:
        return int(chunk_key[:32], 16)
    except ValueError:
        return int(hashlib.blake2b(chunk_key.encode(), digest_size=16).hexdigest(), 16)


_EXTENDED: dict[tuple[str, str], Context] = {}
"""`Context.extend` by (context digest, state digest): a digest names the chain, so the same two
give the same context (digest, keyset, exactness)."""
_EXTENDED_MAX = 1 << 16


class Context:
    """An ordered sequence of antecedent states behind the anchor, chained one state at a time.

    Attributes:
        digest: the chained digest (equal digests: the same antecedent KV, position for position).
        parent: the context without its last state (``None`` for the root).
        last: the last antecedent's state (``None`` for the root).
        length: how many antecedents.
        exact: a re-prefill of its chunks, in order, computes exactly its states' KV (each state is
            exact and conditioned on precisely the states before it here).
        keyset: an order-free fingerprint of the antecedents' content keys (a multiset sum):
            equal for every ordering of the same chunks, the test an orbit patch needs.
    """

    __slots__ = ("digest", "exact", "keyset", "last", "length", "parent")

    def __init__(
        self,
        digest: str,
        parent: Context | None,
        last: ChunkState | None,
        length: int,
        exact: bool,
        keyset: int = 0,
    ) -> None:
        self.digest, self.parent, self.last, self.length, self.exact = digest, parent, last, length, exact
        self.keyset = keyset

    @classmethod
    def root(cls, anchor_key: str) -> Context:
        """The empty context behind the anchor prefix every window shares."""
        return cls(_hash("root", anchor_key), None, None, 0, True)

    def extend(self, state: ChunkState) -> Context:
        """This context followed by one more antecedent (the same two digests: the same context,
        remembered, since every op walks its window's chain again)."""
        link = (self.digest, state.digest)
        known = _EXTENDED.get(link)
        if known is not None:
            return known
        keyset = (self.keyset + _key_hash(state.chunk_key)) & _MASK
        digest = _hash(self.digest, state.digest)
        exact = self.exact and state.exact and state.context.digest == self.digest
        extended = Context(digest, self, state, self.length + 1, exact, keyset)
        if len(_EXTENDED) >= _EXTENDED_MAX:
            _EXTENDED.clear()  # a bound, not a policy: the next walks refill what is in use
        _EXTENDED[link] = extended
        return extended

    def states(self) -> tuple[ChunkState, ...]:
        """The antecedent states, first to last (a walk: for checks and rebuilds, not hot paths)."""
        out: list[ChunkState] = []
        node: Context | None = self
        while node is not None and node.last is not None:
            out.append(node.last)
            node = node.parent
        return tuple(reversed(out))

    @property
    def base(self) -> Context:
        """The root this context grows from."""
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Context) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"Context({self.length} states, {self.digest[:8]})"


class ChunkState:
    """What one chunk's KV encodes. Equal digests mean equal KV (up to relocation).

    Attributes:
        digest: the chained digest (see the module docstring).
        chunk_key: the chunk's content key.
        kind: ``"canonical"`` (no antecedent), ``"patched"`` (canonical + a patch formed over
            ``context``), ``"orbit"`` (canonical + the mean patch of ``members``) or
            ``"spliced"`` (two states' KV, cut at a token: engines' synthesized prefixes) or
            ``"recomputed"`` (``source``'s KV with its most deviating tokens recomputed over
            ``context``: a drift budget's cheapest fix, never exact).
        rank: the patch rank (``"full"``: lossless); 0 for a canonical.
        context: the antecedents it was conditioned on (the root for canonicals and orbits).
        members: an orbit's member states (digests), in the order they were merged.
        address: where an orbit patch is filed (its antecedent set's key); ``""`` otherwise.
        keyset: the order-free fingerprint of the chunks it is conditioned on (`Context.keyset`;
            an orbit's: its set's).
        source: a recomputed state's state before the recompute (``None`` for other kinds).
        share: the share of its tokens a recomputed state recomputed (0 for other kinds).
        head: a recomputed state recomputed its first ``share`` of tokens, not its most deviating.
        exact: a re-prefill of its chain computes the same KV (canonical, or full rank over an
            exact context).
    """

    __slots__ = (
        "address",
        "chunk_key",
        "context",
        "digest",
        "exact",
        "head",
        "keyset",
        "kind",
        "members",
        "rank",
        "share",
        "source",
    )

    def __init__(
        self,
        digest: str,
        chunk_key: str,
        kind: StateKind,
        rank: StateRank,
        context: Context,
        members: tuple[str, ...] = (),
        address: str = "",
        keyset: int | None = None,
        source: ChunkState | None = None,
        share: float = 0.0,
        head: bool = False,
    ) -> None:
        self.digest, self.chunk_key, self.kind, self.rank = digest, chunk_key, kind, rank
        self.context, self.members, self.address = context, members, address
        self.keyset = context.keyset if keyset is None else keyset
        self.source, self.share, self.head = source, share, head
        self.exact = kind == "canonical" or (kind == "patched" and rank == "full" and context.exact)

    @property
    def is_full(self) -> bool:
        """A full-rank patched or orbit state, or a recomputed one: its KV is stored as is (a full
        KV, filed under this digest), not as a patch on the chunk's canonical."""
        return self.rank == "full" and self.kind in ("patched", "orbit", "recomputed")

    @property
    def stored_as(self) -> str:
        """The digest a full-rank state's KV is filed under: its own, except a one-member orbit's,
        whose mean is its member's KV, filed once under the member (`fold_full_orbit`)."""
        if self.kind == "orbit" and len(self.members) == 1:
            return self.members[0]
        return self.digest

    @classmethod
    def canonical(cls, chunk_key: str, root: Context) -> ChunkState:
        """``KV(B | ∅)``: the chunk prefilled behind the anchor alone."""
        return cls(_hash("canonical", chunk_key, root.digest), chunk_key, "canonical", 0, root)

    @classmethod
    def patched(cls, chunk_key: str, rank: StateRank, context: Context) -> ChunkState:
        """The canonical plus a rank-``rank`` patch of the chunk's deficit over ``context``."""
        if context.length == 0:
            return cls.canonical(chunk_key, context)
        return cls(patched_digest(chunk_key, rank, context), chunk_key, "patched", rank, context)

    @classmethod
    def orbit(
        cls,
        chunk_key: str,
        rank: StateRank,
        root: Context,
        address: str,
        members: Sequence[str],
        keyset: int = 0,
    ) -> ChunkState:
        """The canonical plus the orbit patch at ``address`` merged from ``members`` in order
        (``keyset``: the fingerprint of the antecedent set it averages over)."""
        digest = orbit_digest(chunk_key, rank, root, address, members)
        return cls(digest, chunk_key, "orbit", rank, root, tuple(members), address, keyset)

    @classmethod
    def spliced(cls, head: ChunkState, tail: ChunkState, cut: int) -> ChunkState:
        """A chunk whose first ``cut`` tokens hold ``head``'s KV and the rest ``tail``'s: what an
        engine holds when its own prefix hit ends inside a chunk served in another state, or a
        load ends inside one whose remainder a forward computes. Never exact; conditioned on
        ``head``'s context (where the chunk sits)."""
        digest = _hash("spliced", head.digest, tail.digest, str(cut))
        return cls(digest, head.chunk_key, "spliced", tail.rank, head.context)

    @classmethod
    def recomputed(cls, source: ChunkState, context: Context, share: float, head: bool = False) -> ChunkState:
        """``source``'s KV, placed behind ``context``, with its most deviating ``share`` of tokens
        (``head``: its first ``share``) recomputed through every layer over it (`KVCore.recompute`):
        what the other tokens absorbed elsewhere stays, so never exact; its KV is stored whole
        under this digest."""
        kind = "recomputed-head" if head else "recomputed"
        digest = _hash(kind, source.digest, context.digest, f"{share:.6g}")
        return cls(
            digest, source.chunk_key, "recomputed", "full", context, source=source, share=share, head=head
        )

    def antecedents(self) -> tuple[ChunkState, ...]:
        """The states whose KV this state's KV encodes directly: its context's, and a recomputed
        state's source (whose tokens it kept)."""
        states = self.context.states()
        return states if self.source is None else (*states, self.source)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChunkState) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        # "full" where the window's rank is smaller: the chunk's deficit has no more rank than
        # that (few tokens), so its patch is lossless (`effective_rank`)
        rank = "rank full (lossless)" if self.rank == "full" else f"rank {self.rank}"
        if self.kind == "recomputed":
            rank = f"{'first ' if self.head else ''}{self.share:.0%} of tokens recomputed (approximate)"
        return f"ChunkState({self.kind}, {rank}, {self.context.length} antecedents, {self.digest[:8]})"


def patched_digest(chunk_key: str, rank: StateRank, context: Context) -> str:
    """The digest of `ChunkState.patched`, without the state: what a store lookup needs
    (planning asks for most chunks of an op, and most lookups miss)."""
    if context.length == 0:
        return _hash("canonical", chunk_key, context.digest)
    return _hash("patched", chunk_key, str(rank), context.digest)


def effective_rank(rank: StateRank, num_tokens: int, features: int) -> StateRank:
    """The rank a patch of an ``[num_tokens, features]`` deficit really has: ``"full"`` at or
    above ``min(num_tokens, features)`` (the SVD keeps every direction: the patch is lossless)."""
    if rank == "full" or rank >= min(num_tokens, features):
        return "full"
    return rank


def orbit_digest(chunk_key: str, rank: StateRank, root: Context, address: str, members: Sequence[str]) -> str:
    """The digest of `ChunkState.orbit`, without the state: what filing an orbit needs (every
    formation folds into one)."""
    return _hash("orbit", chunk_key, str(rank), root.digest, address, *members)


def orbit_key(chunk_key: str, rank: StateRank, root: Context, context: Context) -> str:
    """Where the orbit patch of a chunk over the *set* of ``context``'s chunks is filed: the same
    for every ordering of them (a multiset of content keys, folded in O(1) per antecedent)."""
    size, keyset = str(context.length), f"{context.keyset:032x}"
    return _hash("orbit-set", chunk_key, str(rank), root.digest, size, keyset)
