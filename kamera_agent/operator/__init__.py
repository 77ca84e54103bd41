"""The position-free KV operator: ``KV_at(B | A, p) = relocate(canonical(B) + patch(B | A), p)``.

``rope`` rotates key bands, ``layout`` says where the band sits for MHA, GQA and MLA, ``patch``
forms and applies the low-rank conditioning patches. Nothing here knows about windows, engines
or model families: a backend hands in the `KVLayout` and `RotarySpec` of its model.
"""

from kamera_agent.operator.layout import (
    ChunkKV,
    KVLayout,
    at_positions,
    check_layout,
    check_positions,
    relocate,
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
    place_many,
    save_patch,
    select_layers,
)
from kamera_agent.operator.rope import RotarySpec, rerotate, rotary_angles, rotate, unrotate

__all__ = [
    "ChunkKV",
    "KVLayout",
    "Patch",
    "Rank",
    "RotarySpec",
    "apply_patch",
    "at_positions",
    "check_layout",
    "check_positions",
    "deficit",
    "form_orbit_patch",
    "form_patch",
    "load_patch",
    "merge_patches",
    "place_many",
    "relocate",
    "rerotate",
    "rotary_angles",
    "rotate",
    "save_patch",
    "select_layers",
    "to_position_free",
    "unrotate",
]
