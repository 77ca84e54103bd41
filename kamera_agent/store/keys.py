"""Entry keys: what the store files an entry under, one kind of key per kind of entry.

Why: canonicals and vision embeddings are keyed by the chunk's content key alone, a patch by
the chunk's content key *and* a variant: the digest of the state it gives the chunk (its
antecedents' states chained in, `kamera_agent.core.identity`), or for an orbit the key of its
antecedent set. Variants are opaque strings made by the caller. One frozen key type
for every kind keeps the tiers generic: they never look inside an entry.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal, NamedTuple

from kamera_agent.store.audits import audit_variant

__all__ = ["EntryKey", "EntryKind"]

EntryKind = Literal["canonical", "full", "vision", "patch", "audit"]
_make = tuple.__new__


class EntryKey(NamedTuple):
    """The address of one store entry (a named tuple: every store lookup hashes and compares one,
    and a tuple does both in C, where a frozen dataclass ran Python for each).

    Attributes:
        kind: ``"canonical"`` (position-free `ChunkKV`), ``"full"`` (the position-free KV of one
            full-rank chunk state, filed under the state's digest), ``"vision"`` (a vision tower's output,
            ``dict[str, Tensor]``), ``"patch"`` (a `Patch`) or ``"audit"`` (a `DriftAudit`: a
            state's measured drift behind one left context).
        key: the chunk's content key (hex string).
        variant: a patch's variant (the state digest it gives, or an orbit's set key), a full
            KV's state digest, an audit's state and left context (`audit_variant`); ``""`` for
            canonicals and vision embeddings.
    """

    kind: EntryKind
    key: str
    variant: str = ""

    # The typed makers build the tuple directly (what a named tuple's own ``__new__`` does, less
    # its Python call): planning and committing make a key per chunk lookup and per entry.
    @classmethod
    def canonical(cls, key: str) -> EntryKey:
        return _make(cls, ("canonical", key, ""))

    @classmethod
    def full(cls, chunk_key: str, state: str) -> EntryKey:
        return _make(cls, ("full", chunk_key, state))

    @classmethod
    def vision(cls, key: str) -> EntryKey:
        return _make(cls, ("vision", key, ""))

    @classmethod
    def patch(cls, chunk_key: str, variant: str) -> EntryKey:
        return _make(cls, ("patch", chunk_key, variant))

    @classmethod
    def audit(cls, chunk_key: str, state: str, left: str) -> EntryKey:
        return cls("audit", chunk_key, audit_variant(state, left))

    @property
    def digest(self) -> str:
        """32 hex digits naming the entry's file: signatures can be long or hold any character."""
        text = json.dumps([self.kind, self.key, self.variant])
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def __str__(self) -> str:
        tail = f" | {self.variant[:16]}" if self.variant else ""
        return f"{self.kind}:{self.key[:16]}{tail}"
