"""The engine-neutral core between the window and the backends.

`KVCore` gets every chunk's KV from the store or one backend primitive (origin checks, the
position-free form, device moves, costs); `StagedStore` makes an operation a transaction over
the store; `ChunkState` and `Context` are the chained identities patches are stored and found
by; `CostMeter` sums what each primitive reported; `select_tokens` picks the tokens a selective
recompute refreshes (`KVCore.recompute`). ``Patch`` is the type of what a rank-m
state carries, named here so the layers above hold patches without doing patch arithmetic.
"""

from kamera_agent.core.costs import CostMeter
from kamera_agent.core.identity import ChunkState, Context, StateKind, StateRank, effective_rank, orbit_key
from kamera_agent.core.kv_core import KVCore, StaleLookup, Txn
from kamera_agent.core.recompute import Recomputed, select_tokens
from kamera_agent.core.staging import Committed, StagedStore, StoreView, can_form
from kamera_agent.operator.patch import Patch

__all__ = [
    "ChunkState",
    "Committed",
    "Context",
    "CostMeter",
    "KVCore",
    "Patch",
    "Recomputed",
    "StagedStore",
    "StaleLookup",
    "StateKind",
    "StateRank",
    "StoreView",
    "Txn",
    "can_form",
    "effective_rank",
    "orbit_key",
    "select_tokens",
]
