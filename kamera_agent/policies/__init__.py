"""Window policies: small strategies registered by name (installed as ``kamera_agent.policies``).

Each registry maps a name to a pure function (or a small record around one), so a
`WindowConfig` names its choices and a new strategy is one function and one dict entry, never
an ``if``/``elif`` on a string:

- `EVICTION`: which chunks leave when a push would overflow the window's capacity;
- `PATCH_TIMING`: when a chunk's conditioning patch is formed (eager, lazy, none);
- `SURVIVORS`: what a slide/evict does to the chunks that stay (keep, removal patch);
- `REORDER`: how a chunk whose antecedents changed is served when no stored patch fits.
"""

from kamera_agent.policies.eviction import EVICTION, Eviction, EvictionContext, EvictionRanking
from kamera_agent.policies.patching import PATCH_TIMING, REORDER, SURVIVORS, PatchAction

__all__ = [
    "EVICTION",
    "PATCH_TIMING",
    "REORDER",
    "SURVIVORS",
    "Eviction",
    "EvictionContext",
    "EvictionRanking",
    "PatchAction",
]
