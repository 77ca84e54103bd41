"""Selective recompute, the engine-neutral part: which rows, what they may attend to, what it costs.

Why shared: an engine runs the forward (its own cache and mask types), but which slots a
recomputed token sees, which vision rows it takes, how fresh rows replace reused ones, how a
token's deviation is measured and what a partial forward costs are the same for every engine.

A recompute forward's cache holds the context and the whole chunk (``cached + n`` slots); its
queries are the ``m`` selected tokens, written into their own chunk slots as the forward computes
them. Engines count the ``cached + n - m`` slots that are not recomputed as "already cached", so
their causal-by-slot rule allows query ``i`` every slot up to ``cached + n - m + i``, which is at
or past its own slot ``cached + indices[i]``; `recompute_hidden` hides the chunk slots after it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from kamera_agent.backends.base import Spent, VisionFeatures
from kamera_agent.operator.layout import ChunkKV

__all__ = [
    "deviation_scores",
    "deviation_spent",
    "recompute_hidden",
    "replace_rows",
    "vision_rows",
]


def recompute_hidden(cached: int, n: int, indices: torch.Tensor) -> torch.Tensor:
    """``[m, cached + n]`` bool, True at the chunk slots after each selected token's own (the
    engine's causal rule, with ``cached + n - m`` slots counted as cached, hides nothing more)."""
    slot = torch.arange(cached + n)
    return slot[None, :] > (cached + indices)[:, None]


def vision_rows(
    vision: VisionFeatures | None, mm_types: torch.Tensor, indices: torch.Tensor
) -> dict[str, torch.Tensor] | None:
    """The vision outputs of the selected image tokens (every feature is one row per image token,
    in token order), or ``None`` when none is selected."""
    image = mm_types == 1
    if vision is None:
        if bool(image.any()):
            raise ValueError(
                "the chunk has image tokens; pass its vision outputs (encode_vision(chunk).features)"
            )
        return None
    order = torch.cumsum(image.long(), 0) - 1  # [n]: each image token's row in the features
    rows = order[indices][image[indices]]
    if rows.numel() == 0:
        return None
    return {name: feature[rows.to(feature.device)] for name, feature in vision.items()}


def replace_rows(kv: ChunkKV, indices: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> ChunkKV:
    """``kv`` with token rows ``indices`` replaced by ``keys`` ``[L, Hk, m, Dk]`` and ``values``
    ``[L, Hv, m, Dv]`` (a copy: ``kv`` itself is left as it was)."""
    new_keys, new_values = kv.keys.clone(), kv.values.clone()
    where = indices.to(kv.keys.device)
    new_keys[:, :, where] = keys.to(new_keys.dtype)
    new_values[:, :, where] = values.to(new_values.dtype)
    return replace(kv, keys=new_keys, values=new_values)


def deviation_scores(
    fresh_keys: torch.Tensor, fresh_values: torch.Tensor, kv: ChunkKV, layer: int
) -> torch.Tensor:
    """``[n]`` float32: each token's relative L2 distance between fresh ``[H, n, D]`` rows and
    ``kv``'s at ``layer``, over both slots (relative to the fresh rows, which are the truth)."""
    parts = ((fresh_keys, kv.keys[layer]), (fresh_values, kv.values[layer]))
    diff = sum(((f.float() - r.to(f.device).float()) ** 2).sum(dim=(0, 2)) for f, r in parts)
    norm = sum((f.float() ** 2).sum(dim=(0, 2)) for f, _ in parts)
    assert isinstance(diff, torch.Tensor) and isinstance(norm, torch.Tensor)
    return (diff / norm.clamp_min(1e-30)).sqrt().cpu()


def deviation_spent(n: int, layers: int, num_layers: int) -> Spent:
    """One partial forward, its tokens counted as full-forward equivalents: ``ceil(n·layers/L)``."""
    return Spent(forwards=1, tokens_prefilled=math.ceil(n * layers / num_layers))
