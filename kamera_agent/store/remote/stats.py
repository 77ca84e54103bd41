"""The shared (Valkey/Redis) tier's fields of a store's stats snapshot.

Why apart from the store: they read the tier's own snapshot (its state, writes behind, outages,
deadlines) beside the store's counters, which no other tier has; the store only adds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kamera_agent.store.remote.tier import RemoteTier

__all__ = ["remote_stats"]


def remote_stats(remote: RemoteTier | None, counts: Mapping[str, int]) -> dict[str, Any]:
    """`StoreStats`' ``remote_*`` fields: the shared tier's state and counters (the store's
    ``counts`` of its hits, misses, errors and refusals; the tier's own of its writes)."""
    if remote is None:
        return {}
    r, c = remote.snapshot(), counts
    return {
        "remote_state": "slow" if r["slow"] and r["state"] == "up" else r["state"],
        **{f"remote_{name}": c[f"remote_{name}"] for name in ("hits", "misses", "errors", "rejected")},
        **{
            f"remote_{name}": r[name]
            for name in (
                "writes",
                "bytes_written",
                "writes_skipped",
                "deadline_misses",
                "deadline_writes",
            )
        },
        "remote_writes_failed": r["writes_failed"],
        "remote_outages": r["outages"],
        "remote_timeout": r["timeout"],
        "remote_slow_calls": r["slow_calls"],
    }
