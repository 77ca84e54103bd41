"""Relative positions of a chunk's tokens: the scheme a backend hands to its chunk encoder.

Why relative: over a whole sequence position ids are translation-equivariant per chunk (each
chunk starts one past the previous chunk's largest id), so a chunk's ids relative to its own
start, plus where the next chunk starts (``advance``), are all a window needs to place it
anywhere. 1-D RoPE is `LinearPositions`; M-RoPE schemes come from the engine's own position
code (the transformers backend asks the model's ``get_rope_index``).
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["LinearPositions", "PositionScheme"]


class PositionScheme(Protocol):
    """Relative positions ``[n]`` or ``[3, n]`` of a chunk and its advance."""

    is_mrope: bool

    def relative(
        self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> tuple[torch.Tensor, int]: ...

    def text(self, start: int, length: int) -> torch.Tensor:
        """Absolute positions of ``length`` text tokens starting at ``start``."""
        ...


class LinearPositions:
    """1-D RoPE: token ``i`` of a chunk sits at ``start + i``."""

    is_mrope = False

    def relative(
        self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> tuple[torch.Tensor, int]:
        n = int(input_ids.shape[0])
        return torch.arange(n), n

    def text(self, start: int, length: int) -> torch.Tensor:
        return torch.arange(start, start + length)
