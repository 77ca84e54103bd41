"""`Backend` engines a window runs on, behind one seam (`kamera_agent.backends.base`, where the
primitives' result types live): transformers (reference, CPU/GPU) and a plain-torch model that
proves the seam. kamera inside a serving engine (SGLang, vLLM) is `kamera_agent.engines`."""

from kamera_agent.backends.base import Backend, DecodeConfig
from kamera_agent.backends.runs import PlacedChunk, PrefillRun
from kamera_agent.backends.transformers import TransformersBackend

__all__ = ["Backend", "DecodeConfig", "PlacedChunk", "PrefillRun", "TransformersBackend"]
