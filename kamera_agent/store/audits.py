"""A measured drift, filed in the store: what a chunk's reused KV was found to be off by.

Why stored: an audit (`kamera_agent.fidelity`) costs a partial forward and depends only on what
the chunk's KV encodes and what its left context encodes (two chained digests), so it is a fact
every reader of the store can use: a window in another process or node does not audit that pair
again, and an engine adapter, which cannot recompute tokens to audit, serves a kept state only
where an audit filed here vouches for it (`kamera_agent.engines.synthesis`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DriftAudit", "audit_variant"]


@dataclass(frozen=True)
class DriftAudit:
    """One chunk's KV in one state, measured behind one left context.

    Attributes:
        chunk_key: the chunk's content key.
        state: digest of the state its KV was in (`kamera_agent.core.identity.ChunkState`).
        left: digest of the context to its left it was measured behind (`Context`).
        error: the relative KV error against the model's own forward over that context, on the
            measured token rows (a sampled audit) or every row.
        tokens: how many of the chunk's tokens were measured.
        model_fingerprint: the model that measured it.
    """

    chunk_key: str
    state: str
    left: str
    error: float
    tokens: int
    model_fingerprint: str = ""


def audit_variant(state: str, left: str) -> str:
    """The variant an audit is filed under: its state and left context together."""
    return f"{state}@{left}"
