"""Process-wide runtime settings that kamera-agent applies on request, never on import.

Why: torch defaults to one thread per core. On small, busy machines oversubscribed threads
made small ops 25x slower than one thread, so the thread count is a setting that the CLI,
benchmarks and tests pin explicitly (``KAMERA_NUM_THREADS`` or an argument).
"""

from __future__ import annotations

import os

import torch

__all__ = ["THREADS_ENV", "configure_threads"]

THREADS_ENV = "KAMERA_NUM_THREADS"


def configure_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op thread count and return it.

    Args:
        num_threads: the count; ``None`` reads ``KAMERA_NUM_THREADS`` and falls back to 1.

    Raises:
        ValueError: a count below 1, or an environment value that is not an integer.
    """
    if num_threads is None:
        raw = os.environ.get(THREADS_ENV, "1")
        try:
            num_threads = int(raw)
        except ValueError as exc:
            raise ValueError(f"{THREADS_ENV}={raw!r} is not an integer thread count") from exc
    if num_threads < 1:
        raise ValueError(f"thread count must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads)
    return num_threads
