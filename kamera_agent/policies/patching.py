"""Patch policies: when conditioning patches are formed, and what happens when context changes.

Each returns a `PatchAction` for one chunk; the window's planner turns actions into edits:

- ``"form"``: run the chunk's conditioned forward over its new left context and patch (exact);
- ``"keep"``: keep the patch it has (rotation only; its KV still encodes what it encoded);
- ``"revert"``: drop its patch and serve the canonical (blind: encodes nothing);
- ``"defer"``: form it later, before the next read of the window.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

__all__ = ["PATCH_TIMING", "REORDER", "SURVIVORS", "PatchAction"]

PatchAction = Literal["form", "keep", "revert", "defer"]

# When a pushed chunk's patch is formed (patch_mode).
PATCH_TIMING: Mapping[str, PatchAction] = MappingProxyType(
    {"eager": "form", "lazy": "defer", "none": "revert"}
)

# What a slide / evict does to survivors: they keep their absorbed conditioning on the chunk
# that left (free, and approximate: what they absorbed from it is still in their KV, which the
# drift budget measures and fixes), or re-form it without that chunk (a removal patch: exact).
SURVIVORS: Mapping[str, PatchAction] = MappingProxyType({"keep": "keep", "removal": "form"})

# A reordered chunk whose antecedents changed and for which no stored patch fits: form an
# exact patch, keep its old one where that stays causal, or fall back to the canonical.
REORDER: Mapping[str, PatchAction] = MappingProxyType({"form": "form", "keep": "keep", "revert": "revert"})
