"""Wall time of work an accelerator may still be running."""

from __future__ import annotations

import time

import torch

__all__ = ["wall"]


def wall() -> float:
    """``time.perf_counter()`` after the GPU finished its queued work (CUDA runs asynchronously:
    without this a timed op would end when its kernels were queued, not when they ran)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()
