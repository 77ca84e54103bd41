"""Engines kamera-agent drives: transformers (reference, CPU/GPU); SGLang follows."""

from kamera_agent.backends.base import Answer, Backend, BackendCounters, DecodeConfig
from kamera_agent.backends.transformers_backend import TransformersBackend

__all__ = ["Answer", "Backend", "BackendCounters", "DecodeConfig", "TransformersBackend"]
