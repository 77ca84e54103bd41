"""vLLM's paged per-layer caches as `KVSlots`: each layer addressed as its attention backend lays it out.

Why a module of its own: the connector must write exactly what the attention kernel reads (a
load) and read back exactly what the kernel's cache write put there (a capture). How a layer is
addressed, the backend vLLM picked decides; `addressing` holds the table, chosen once per layer at
``register_kv_caches`` (an unknown one fails there, by name), and this module applies it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kamera_agent.engines.slots import KVSlots
from kamera_agent.engines.vllm.addressing import (
    BlockAddressingError,
    LayerAddressing,
    layer_addressing,
    read_tokens,
    write_tokens,
)
from kamera_agent.errors import LayoutMismatchError
from kamera_agent.moved import renamed
from kamera_agent.operator.layout import ChunkKV, KVLayout

__all__ = ["BlockAddressingError", "PlacedLayer", "VLLMSlots", "place_layers"]


@dataclass(frozen=True)
class PlacedLayer:
    """One registered cache as a layer of the model.

    Attributes:
        name: vLLM's layer name.
        index: the model's layer (global: a pipeline stage's first layer is not 0).
        cache: the view vLLM registered.
        addressing: how its backend lays a token out (kamera's own word, *layout*, is the model's KV).
        shared: the cache is another layer's (vLLM's cross-layer KV sharing): read, never written.
    """

    name: str
    index: int
    cache: torch.Tensor
    addressing: LayerAddressing
    shared: bool = False


class VLLMSlots(KVSlots):
    """vLLM's per-layer paged caches of one rank as `KVSlots` over layers ``first..end``.

    A `ChunkKV` written or read holds exactly those layers (``[end - first, heads, n, dim]``,
    this rank's heads): a pipeline stage's piece of a chunk.
    """

    def __init__(self, layers: Sequence[PlacedLayer], layout: KVLayout) -> None:
        self.layers, self.layout = sorted(layers, key=lambda p: p.index), layout
        indices = [p.index for p in self.layers]
        self.first = indices[0] if indices else 0
        self.end = indices[-1] + 1 if indices else 0
        if indices != list(range(self.first, self.end)):
            raise BlockAddressingError(
                f"the KV caches vLLM registered are layers {indices} of the model: not one cache per "
                "layer of a contiguous range, which kamera's entries need"
            )

    @property
    def caches(self) -> list[torch.Tensor]:
        return [p.cache for p in self.layers]

    @property
    def addressings(self) -> list[LayerAddressing]:
        return [p.addressing for p in self.layers]

    @classmethod
    def of(
        cls, caches: Sequence[torch.Tensor], backends: Sequence[str], layout: KVLayout, heads: int
    ) -> VLLMSlots:
        """The slots of ``caches`` (layers ``0..``) run by ``backends`` (``get_name()`` per layer),
        ``heads`` KV heads per layer. Raises `BlockAddressingError` for anything it cannot address."""
        placed = [
            PlacedLayer(str(i), i, c, layer_addressing(b, c, layout, heads))
            for i, (c, b) in enumerate(zip(caches, backends, strict=True))
        ]
        return cls(placed, layout)

    def write_placed(self, kv: ChunkKV, slots: torch.Tensor) -> None:
        self._check(kv.keys.shape[0])
        for p in self.layers:
            if not p.shared:  # its cache is another layer's, written as that one
                keys, values = kv.keys[p.index - self.first], kv.values[p.index - self.first]
                write_tokens(p.cache, p.addressing, keys.transpose(0, 1), values.transpose(0, 1), slots)

    def read_placed(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.gather(slots)
        return keys.float().cpu(), values.float().cpu()

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` ``[n]`` as the caches hold them: ``[layers, heads, n, dim]``
        each, in the cache's dtype, on its device."""
        return self.unpack(*self.copy_blocks(slots))

    def copy_blocks(self, slots: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The blocks holding ``slots``, whole, of every layer (``[blocks, heads, block_size, C]``
        each, contiguous, in the cache's dtype, on its device), and the rows of those copies the
        slots are (``block's index among them × block_size + offset``, on the CPU).

        Why whole blocks: a block is one contiguous run of each layer's view, so copying it is a
        plain memory copy, where picking tokens out of it (`unpack`) strides through every head
        (CPU attention keeps keys transposed): a capture copies blocks on vLLM's step, which must
        not wait, and unpacks them on its writer's thread. The block indices are worked out on the
        CPU, so nothing here waits for the device."""
        blocks, rows = self.locate(slots)
        return self.copy(blocks), rows

    def locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks holding ``slots`` (each once, in the order met) and the slots' rows of a copy
        of those blocks (`copy_blocks`), both on the CPU."""
        slots = slots.to("cpu", torch.long)
        block_size = self.block_size
        for p in self.layers:
            if p.cache.shape[2] != block_size:
                raise BlockAddressingError(
                    f"layer {p.name} has blocks of {p.cache.shape[2]} tokens, layer "
                    f"{self.layers[0].name} of {block_size}: one slot cannot address both"
                )
        blocks, offsets = slots // block_size, slots % block_size
        unique, inverse = torch.unique_consecutive(blocks, return_inverse=True)
        return unique, inverse * block_size + offsets

    def copy(self, blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every layer's ``blocks``, whole and contiguous, in the cache's dtype, on its device."""
        return tuple(
            p.cache.index_select(0, blocks.to(p.cache.device, non_blocking=True)) for p in self.layers
        )

    @property
    def block_size(self) -> int:
        """Tokens of one block of the views (a kernel block where vLLM splits its own)."""
        return int(self.layers[0].cache.shape[2]) if self.layers else 1

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer (what `copy` takes per block)."""
        return sum(p.cache[0].numel() * p.cache.element_size() for p in self.layers)

    def unpack(self, copies: Sequence[torch.Tensor], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[layers, heads, n, dim]`` at ``rows`` of ``copies`` (`copy_blocks`),
        each layer read as its backend lays it out, on the copies' device."""
        pairs = [read_tokens(copy, p.addressing, rows) for copy, p in zip(copies, self.layers, strict=True)]
        keys = torch.stack([k.transpose(0, 1) for k, _ in pairs])
        values = torch.stack([v.transpose(0, 1) for _, v in pairs])
        return keys, values

    def _check(self, layers: int) -> None:
        if layers != self.end - self.first:
            raise LayoutMismatchError(
                f"a chunk piece of {layers} layers for caches of layers {self.first}..{self.end - 1}"
            )


def place_layers(
    caches: Mapping[str, torch.Tensor],
    backends: Mapping[str, str],
    layout: KVLayout,
    heads: int,
    index_of: Callable[[str], int],
) -> tuple[list[PlacedLayer], list[str]]:
    """The registered caches that are layers of the model, by name, and the names skipped.

    A cache is the model's layer ``index_of(name)`` where its name follows the pattern most names
    follow (``model.layers.{i}.self_attn.attn``) and the index is one of the model's layers; the
    rest are skipped by name: a draft model's layers (EAGLE, MTP: another prefix, or indices past
    the model's) and names without one layer index. A cache that is the same memory as one
    already placed is that layer's KV reused (cross-layer sharing): placed, marked shared.
    """
    patterns: dict[str, str] = {}
    for name in caches:
        patterns[name] = re.sub(r"\.\d+(?=\.|$)", ".{}", name)
    counts = Counter(patterns.values())
    main = counts.most_common(1)[0][0] if counts else ""
    placed: list[PlacedLayer] = []
    skipped: list[str] = []
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, cache in caches.items():
        try:
            index = int(index_of(name))
        except (ValueError, AssertionError, TypeError):
            index = -1
        if patterns[name] != main or not 0 <= index < layout.num_layers:
            skipped.append(name)
            continue
        memory = (cache.data_ptr(), tuple(cache.shape), tuple(cache.stride()))
        shared = memory in seen
        seen.setdefault(memory, name)
        placed.append(
            PlacedLayer(name, index, cache, layer_addressing(backends[name], cache, layout, heads), shared)
        )
    return placed, skipped


__getattr__ = renamed(__name__, {"BlockLayoutError": "BlockAddressingError"})
"""*Layout* is the model's KV (`KVLayout`); how the connector addresses vLLM's blocks is their
addressing. The old name lasts a release."""
