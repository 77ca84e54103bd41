"""M-RoPE positions from the model's own ``get_rope_index`` (Qwen2/2.5/3-VL).

Why ask the model: M-RoPE ids for vision tokens follow the image grid (and, for video, the
time step), and each family has its own rules; the model's ``get_rope_index`` is the reference.
"""

from __future__ import annotations

from typing import Any

import torch

from kamera_agent.chunks.positions import LinearPositions, PositionScheme

__all__ = ["MRopePositions", "position_scheme"]


class MRopePositions:
    """M-RoPE (Qwen2/2.5/3-VL): rows t, h, w from the model's ``get_rope_index``."""

    is_mrope = True

    def __init__(self, model: Any) -> None:
        self._get_rope_index = model.model.get_rope_index

    def relative(
        self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> tuple[torch.Tensor, int]:
        n = int(input_ids.shape[0])
        if image_grid_thw is None:  # text: t = h = w
            return torch.arange(n).expand(3, n).clone(), n
        ids, _ = self._get_rope_index(
            input_ids[None].to(self._device()),
            mm_token_type_ids=mm_token_type_ids[None].to(self._device()),
            image_grid_thw=image_grid_thw.to(self._device()),
            video_grid_thw=None,
            attention_mask=None,
        )
        relative = ids[:, 0].to("cpu", torch.long)  # [3, n], starting at 0
        return relative, int(relative.max()) + 1

    def text(self, start: int, length: int) -> torch.Tensor:
        return torch.arange(start, start + length).expand(3, length).clone()

    def _device(self) -> torch.device:
        owner = getattr(self._get_rope_index, "__self__", None)
        return next(owner.parameters()).device if owner is not None else torch.device("cpu")


def position_scheme(model: Any, is_mrope: bool) -> PositionScheme:
    """The scheme for a model: M-RoPE when its rotary spec has t/h/w axes, else linear."""
    return MRopePositions(model) if is_mrope else LinearPositions()
