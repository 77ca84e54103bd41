"""Which tokens of a placed chunk to recompute: the ones whose reused KV deviates most.

Why this rule: what a chunk's reused KV lacks is what its context would have given it, and
that differs from token to token (CacheBlend: a small share of tokens carries most of it). A
cheap partial forward (`Backend.deviation`) measures each token's deviation at one early layer;
recomputing the largest share restores most of the conditioning for that share of a prefill.
It needs nothing a real system lacks: no exact KV, no oracle, only the context and the chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kamera_agent.errors import SettingsError
from kamera_agent.moved import renamed
from kamera_agent.operator.layout import ChunkKV

__all__ = ["Recomputed", "select_tokens", "selected_count"]


@dataclass(frozen=True)
class Recomputed:
    """A chunk's KV after selective recompute.

    Attributes:
        kv: the chunk's KV with the selected tokens' rows recomputed over its context.
        indices: ``[m]`` the recomputed tokens, sorted.
        scores: ``[n]`` each token's deviation that chose them; ``None`` when every token was
            recomputed (nothing to choose, so no probe ran).
    """

    kv: ChunkKV
    indices: torch.Tensor
    scores: torch.Tensor | None


def selected_count(fraction: float, n: int) -> int:
    """``ceil(fraction · n)`` (rounded first, so 0.07 · 100 is 7, not 8), for a fraction in (0, 1]."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise SettingsError(
            f"the recompute fraction must be a number in (0, 1] (the share of the chunk's tokens to "
            f"recompute; 1 re-prefills the chunk), got {fraction!r}"
        )
    return math.ceil(round(fraction * n, 9))


def select_tokens(deviation: torch.Tensor, fraction: float) -> torch.Tensor:
    """The ``ceil(fraction · n)`` tokens with the largest ``deviation`` ``[n]``, as sorted indices.

    Raises:
        SettingsError: ``fraction`` is not in (0, 1], or ``deviation`` is not a 1-D float tensor
            of finite scores.
    """
    if deviation.ndim != 1 or not deviation.dtype.is_floating_point or not bool(deviation.isfinite().all()):
        raise SettingsError(
            f"deviation must be a 1-D float tensor of finite scores, one per token (Backend.deviation), "
            f"got {deviation.dtype} of shape {tuple(deviation.shape)}"
        )
    count = selected_count(fraction, int(deviation.shape[0]))
    top = torch.topk(deviation.float().cpu(), count).indices
    return top.sort().values


__getattr__ = renamed(__name__, {"Blended": "Recomputed"})
"""The module was ``core.blend``, its result ``Blended``: the old name lasts a release."""
