"""The position-free KV operator: ``KV_at(B | A, p) = rotate(canonical(B) + patch(B | A), p)``.

``rope`` rotates key bands, ``families``/``layout`` say where the band sits for MHA, GQA and
MLA, ``patch`` forms and applies the low-rank conditioning patches. Nothing here knows about
windows or engines.
"""

from kamera_agent.operator.families import FAMILIES, Family, family_of
from kamera_agent.operator.layout import (
    ChunkKV,
    KVLayout,
    at_positions,
    check_layout,
    kv_layout,
    read_chunk,
    rotary_spec,
    to_position_free,
)
from kamera_agent.operator.patch import (
    Patch,
    Rank,
    apply_patch,
    deficit,
    form_orbit_patch,
    form_patch,
    load_patch,
    merge_patches,
    save_patch,
    select_layers,
)
from kamera_agent.operator.rope import RotarySpec, relocate, rotary_angles, rotate, unrotate

__all__ = [
    "FAMILIES",
    "ChunkKV",
    "Family",
    "KVLayout",
    "Patch",
    "Rank",
    "RotarySpec",
    "apply_patch",
    "at_positions",
    "check_layout",
    "deficit",
    "family_of",
    "form_orbit_patch",
    "form_patch",
    "kv_layout",
    "load_patch",
    "merge_patches",
    "read_chunk",
    "relocate",
    "rotary_angles",
    "rotary_spec",
    "rotate",
    "save_patch",
    "select_layers",
    "to_position_free",
    "unrotate",
]
