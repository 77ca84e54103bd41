"""kamera-agent: keep, move, drop and bring back multimodal context without paying for it again.

A chunk (frame, screenshot, page, text span) is cached once, position-free; reuse is an exact
RoPE relocation plus a small low-rank patch that restores what the chunk absorbed from the
chunks before it. See shared/DESIGN.md and docs/ for the picture.
"""

from kamera_agent.errors import (
    ForeignPatchError,
    KameraError,
    LayoutMismatchError,
    LengthDependentRopeError,
    PositionShapeError,
    RelocationError,
    UnsupportedModelError,
)
from kamera_agent.fingerprint import model_fingerprint
from kamera_agent.operator import ChunkKV, KVLayout, Patch, RotarySpec, apply_patch, form_patch, kv_layout
from kamera_agent.settings import configure_threads

__version__ = "0.1.0"

__all__ = [
    "ChunkKV",
    "ForeignPatchError",
    "KVLayout",
    "KameraError",
    "LayoutMismatchError",
    "LengthDependentRopeError",
    "Patch",
    "PositionShapeError",
    "RelocationError",
    "RotarySpec",
    "UnsupportedModelError",
    "__version__",
    "apply_patch",
    "configure_threads",
    "form_patch",
    "kv_layout",
    "model_fingerprint",
]
