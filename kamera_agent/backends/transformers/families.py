"""Model families kamera-agent knows, and how each lays out its rotary features.

Why a table: the inverse frequencies and scaling are read from the loaded model itself (see
`kamera_agent.backends.transformers.reading`), but *which* features a frequency rotates is decided by code
in the model's attention (``rotate_half`` versus complex pairs), not by any attribute we can
read. Each entry below was checked against the attention code of its transformers class and
is tested against the model's own forward. A new family is one line here plus a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kamera_agent.errors import UnsupportedModelError
from kamera_agent.operator.rope import Pairing

__all__ = ["FAMILIES", "Family", "family_of"]

MRopeStyle = Literal["blocked", "interleaved"]
Attention = Literal["standard", "mla"]


@dataclass(frozen=True)
class Family:
    """How one model family stores keys.

    Attributes:
        name: the family's name in messages and reports.
        pairing: rotary feature pairing of the *cached* keys.
        mrope: ``None`` for 1-D RoPE, else how ``mrope_section`` assigns frequencies to t/h/w:
            ``"blocked"`` (Qwen2-VL, Qwen2.5-VL: contiguous sections) or ``"interleaved"``
            (Qwen3-VL: t, h, w take turns over the frequencies).
        attention: ``"standard"`` (MHA/GQA: the cache holds rotated keys and values) or
            ``"mla"`` (the cache holds the latent c_KV and the rotated k_pe band).
    """

    name: str
    pairing: Pairing
    mrope: MRopeStyle | None = None
    attention: Attention = "standard"


_LLAMA_LIKE = Family("llama-like", "half")
_GLM = Family("glm", "interleaved")

# Keyed by ``config.model_type`` of the language model (its text config for VLMs).
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen2_moe": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "qwen3_moe": _LLAMA_LIKE,
    "phi": Family("phi", "half"),
    "phi3": Family("phi3", "half"),
    "glm": _GLM,
    "glm4": _GLM,
    "qwen2_vl": Family("qwen2-vl", "half", mrope="blocked"),
    "qwen2_vl_text": Family("qwen2-vl", "half", mrope="blocked"),
    "qwen2_5_vl": Family("qwen2.5-vl", "half", mrope="blocked"),
    "qwen2_5_vl_text": Family("qwen2.5-vl", "half", mrope="blocked"),
    "qwen3_vl": Family("qwen3-vl", "half", mrope="interleaved"),
    "qwen3_vl_text": Family("qwen3-vl", "half", mrope="interleaved"),
    # Gemma 3's text models: sliding-window layers rotating by one base, global ones by another
    # (read per layer from the rotary module; the backend masks each layer type by position).
    "gemma3_text": Family("gemma3", "half"),
    # DeepSeek-V2 rotates k_pe as complex pairs and caches it interleaved.
    "deepseek_v2": Family("deepseek-v2", "interleaved", attention="mla"),
    # DeepSeek-V3 caches k_pe half-split either way: with rope_interleave=True its attention
    # de-interleaves while rotating, without it the band is half-split to begin with.
    "deepseek_v3": Family("deepseek-v3", "half", attention="mla"),
}


_REFUSED: dict[str, str] = {
    "gemma3": "Gemma 3's vision-language models attend bidirectionally among an image's tokens, which "
    "kamera's causal chunks do not model; its text models (Gemma3ForCausalLM) are supported",
}
"""Model types whose language model is a known family but whose whole model is not supported."""


def family_of(config: Any) -> Family:
    """The family of a transformers config (its text config first, for VLMs).

    Raises:
        UnsupportedModelError: naming the model type and the supported ones.
    """
    refused = _REFUSED.get(getattr(config, "model_type", None) or "")
    if refused is not None:
        raise UnsupportedModelError(refused)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for model_type in (getattr(text_config, "model_type", None), getattr(config, "model_type", None)):
        if model_type in FAMILIES:
            return FAMILIES[model_type]
    kind = getattr(text_config, "model_type", None) or getattr(config, "model_type", "?")
    raise UnsupportedModelError(
        f"model type {kind!r} is not supported yet; supported: {', '.join(sorted(FAMILIES))}. "
        "Adding one is a Family entry in kamera_agent/backends/transformers/families.py plus an "
        "exactness test."
    )
