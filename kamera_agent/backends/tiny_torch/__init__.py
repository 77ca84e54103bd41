"""A plain-torch engine behind the seam: a tiny RoPE vision-language model, its byte tokenizer
and patch image processor, and `TinyTorchBackend`.

Why: a second backend that shares no code with transformers (interleaved rotary pairs, its own
cache layout) shows the seam carries no transformers assumption; it also gives fast, download-free
exactness checks against a model's own forward.
"""

from __future__ import annotations

from kamera_agent.backends.tiny_torch.backend import TINY_PROMPT, TinyTorchBackend
from kamera_agent.backends.tiny_torch.model import TinyConfig, TinyKVCache, TinyRopeLM
from kamera_agent.backends.tiny_torch.tokenizer import SPECIAL_TOKENS, TinyByteTokenizer, TinyImageProcessor

__all__ = [
    "SPECIAL_TOKENS",
    "TINY_PROMPT",
    "TinyByteTokenizer",
    "TinyConfig",
    "TinyImageProcessor",
    "TinyKVCache",
    "TinyRopeLM",
    "TinyTorchBackend",
]
