"""Exceptions raised by kamera-agent.

Every error names the problem and the fix, and is raised *before* anything is mutated, so a
failed call never corrupts a window or a store.

    KameraError
    ├── UnsupportedModelError        model family we have no rotary spec / KV layout for
    ├── RelocationError              the rotary scheme cannot be relocated exactly
    │   └── LengthDependentRopeError dynamic NTK, longrope: frequencies change with length
    ├── PositionShapeError           positions of the wrong shape / length for the keys
    ├── LayoutMismatchError          tensors whose shapes do not match the model's KV layout
    └── ForeignPatchError            a patch or chunk made for another chunk or another model
"""

from __future__ import annotations

__all__ = [
    "ForeignPatchError",
    "KameraError",
    "LayoutMismatchError",
    "LengthDependentRopeError",
    "PositionShapeError",
    "RelocationError",
    "UnsupportedModelError",
]


class KameraError(Exception):
    """Base class of every error kamera-agent raises on purpose."""


class UnsupportedModelError(KameraError):
    """The model's family has no known rotary layout or KV layout."""


class RelocationError(KameraError):
    """Keys of this model cannot be moved to a new position by an exact rotation."""


class LengthDependentRopeError(RelocationError):
    """The rotary frequencies depend on the sequence length, so a stored key has no fixed phase."""


class PositionShapeError(KameraError, ValueError):
    """Positions do not match the keys (wrong rank, wrong length, or 1-D where M-RoPE needs 3 rows)."""


class LayoutMismatchError(KameraError, ValueError):
    """A tensor's shape does not match the KV layout it is used with."""


class ForeignPatchError(KameraError):
    """A patch applied to a chunk, or a chunk used with a model, that it was not made for."""
