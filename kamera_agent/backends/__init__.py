"""`Backend` engines a window runs on, behind one seam: transformers (reference, CPU/GPU) and a
plain-torch model that proves the seam. kamera inside a serving engine (SGLang, vLLM) is
`kamera_agent.engines`."""

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
