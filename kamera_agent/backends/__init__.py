"""Engines kamera-agent drives, behind one seam (`Backend`): transformers (reference, CPU/GPU)
and a plain-torch model that proves the seam; SGLang follows."""

from kamera_agent.backends.base import (
    Answer,
    Backend,
    DecodeConfig,
    Decoded,
    Prefilled,
    Reference,
    Spent,
    VisionFeatures,
    VisionOutput,
)
from kamera_agent.backends.transformers import TransformersBackend

__all__ = [
    "Answer",
    "Backend",
    "DecodeConfig",
    "Decoded",
    "Prefilled",
    "Reference",
    "Spent",
    "TransformersBackend",
    "VisionFeatures",
    "VisionOutput",
]
