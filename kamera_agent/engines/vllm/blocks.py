"""vLLM's paged per-layer caches as `KVSlots`: each layer addressed as its attention backend lays it out.

Why a module of its own: the connector must write exactly what the attention kernel reads (a
load) and read back exactly what the kernel's cache write put there (a capture). Which layout
that is, the backend vLLM picked decides; `layouts` holds the table, chosen once per layer at
``register_kv_caches`` (an unknown one fails there, by name), and this module applies it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kamera_agent.engines.slots import KVSlots
from kamera_agent.engines.vllm.layouts import (
    BlockLayoutError,
    LayerLayout,
    layer_layout,
    read_tokens,
    write_tokens,
)
from kamera_agent.operator.layout import ChunkKV, KVLayout

__all__ = ["BlockLayoutError", "VLLMSlots"]


class VLLMSlots(KVSlots):
    """vLLM's per-layer paged caches (in the model's layer order) as `KVSlots`.

    Args:
        caches: one registered view per layer.
        layouts: each layer's `LayerLayout` (`VLLMSlots.of` chooses them).
        layout: the model's KV layout (relocation).
    """

    def __init__(
        self, caches: Sequence[torch.Tensor], layouts: Sequence[LayerLayout], layout: KVLayout
    ) -> None:
        if len(caches) != len(layouts):
            raise BlockLayoutError(f"{len(caches)} caches but {len(layouts)} layouts")
        self.caches, self.layouts, self.layout = list(caches), list(layouts), layout

    @classmethod
    def of(
        cls, caches: Sequence[torch.Tensor], backends: Sequence[str], layout: KVLayout, heads: int
    ) -> VLLMSlots:
        """The slots of ``caches`` run by ``backends`` (``get_name()`` per layer), ``heads`` KV heads
        per layer on this rank. Raises `BlockLayoutError` for anything the connector cannot address."""
        layouts = [layer_layout(b, c, layout, heads) for c, b in zip(caches, backends, strict=True)]
        return cls(caches, layouts, layout)

    def write_placed(self, kv: ChunkKV, slots: torch.Tensor) -> None:
        for layer, (cache, where) in enumerate(zip(self.caches, self.layouts, strict=True)):
            keys, values = kv.keys[layer].transpose(0, 1), kv.values[layer].transpose(0, 1)
            write_tokens(cache, where, keys, values, slots)

    def read_placed(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [read_tokens(c, where, slots) for c, where in zip(self.caches, self.layouts, strict=True)]
        keys = torch.stack([k.transpose(0, 1) for k, _ in pairs]).float().cpu()
        values = torch.stack([v.transpose(0, 1) for _, v in pairs]).float().cpu()
        return keys, values
