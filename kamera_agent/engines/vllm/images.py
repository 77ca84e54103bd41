"""A vLLM request's images as kamera image spans: where each sits and what names its content.

Why not vLLM's hash alone: vLLM names an image by a hash of what it was given (the file's
pixels, the model, the processor's settings), which only vLLM computes; a window names it by
the patches the processor cuts it into (`image_identity`). Keyed the window's way, the image KV
a `vllm serve` captures is the KV a window pushing the same image finds, and the reverse.
vLLM's processor output is at hand on the scheduler side (``mm_features[i].data``) when its
processor cache sends it there (its default ``lru``); under its default
``mm_device_do_normalize`` those are the patches before rescaling and normalizing, the ones a
window hashes. Each identity is computed once per vLLM hash (`ImageIdentities` remembers it), so
an image seen again costs a dictionary look-up. An image whose output vLLM did not send
(``mm_processor_cache_type="shm"``) and that is not remembered keeps vLLM's hash
(``vllm:<hash>``): engines still share it, windows do not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kamera_agent.chunks.chunk import image_identity
from kamera_agent.engines.chunking import ImageSpan

__all__ = ["ImageIdentities", "images_only"]

REMEMBERED = 4096
"""vLLM hashes whose identity is kept (a few hundred bytes each)."""


class ImageIdentities:
    """Image identities by vLLM's content hash, least recently used forgotten first."""

    def __init__(self, size: int = REMEMBERED) -> None:
        self._known: OrderedDict[str, str] = OrderedDict()
        self._size = size

    def spans(self, features: Sequence[Any]) -> list[ImageSpan]:
        """The request's image spans, each named by its content (`identity`)."""
        return [
            ImageSpan(f.mm_position.offset, f.mm_position.offset + f.mm_position.length, self.identity(f))
            for f in features
        ]

    def identity(self, feature: Any) -> str:
        """The content identity of one image feature: its processed pixels and grid, or vLLM's
        hash where neither they nor a remembered identity are at hand."""
        vllm_hash = str(feature.identifier)
        known = self._known.get(vllm_hash)
        if known is not None:
            self._known.move_to_end(vllm_hash)
            return known
        data = feature.data
        pixels = _field(data, "pixel_values")
        if pixels is None:
            return f"vllm:{vllm_hash}"
        found = image_identity(pixels, _field(data, "image_grid_thw"))
        self._known[vllm_hash] = found
        if len(self._known) > self._size:
            self._known.popitem(last=False)
        return found


def images_only(features: Sequence[Any], with_data: bool) -> bool:
    """Every feature is an image (and, ``with_data``, carries its processed data, which M-RoPE
    positions are computed from): a video's or audio's placeholders have no identity here, and
    as text they would key alike whatever they hold."""
    return all(f.modality == "image" and (f.data is not None or not with_data) for f in features)


def _field(data: Any, name: str) -> Any:
    """``data[name]``'s tensor (a `MultiModalKwargsItem` field), or ``None``."""
    if data is None or name not in data:
        return None
    return data[name].data
