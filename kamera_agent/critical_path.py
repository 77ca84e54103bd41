"""The critical path of a window op: from its first forward to its answer, with no host round trip.

Why: on a GPU the engine queues kernels and returns; anything that makes the host wait for them
(``Tensor.item``, ``.tolist``, ``.cpu``, ``.numpy``, ``float(t)``, ``int(t)``, ``bool(t)``, a copy
from pageable host memory that must finish before the host goes on) stalls the queue, so
kamera's own work could no longer overlap the engine's. A prefix cache pays no such stall, so
kamera must not either between the op's forward and its answer. The span is marked here:

- `critical_path`: the runner wraps an op's execution and its read (the answer) in it;
- `answered`: the answer boundary. A decode must move the chosen token id to the host to turn it
  into text and to see whether it ends the answer; the first such move ends the span;
- `books`: a stretch inside the span that needs a value on the host to decide something (the
  drift budget's audits compare an error with ε). Each use names why, and each is listed in
  docs/architecture.md;
- `to_device`: a host tensor moved to an accelerator from pinned memory, without a wait.

`on_critical_path` says whether a call runs inside the span (a test patches the host round
trips to raise there). The mark is a `contextvars.ContextVar`: per thread and per task, as an op
is (a window serializes its ops; two windows in two threads each have their own span).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

__all__ = ["answered", "books", "critical_path", "on_critical_path", "to_device"]

_SPAN: ContextVar[bool] = ContextVar("kamera_critical_path", default=False)


@contextmanager
def critical_path() -> Iterator[None]:
    """Mark the block as an op's span from its forward to its answer (ended early by `answered`)."""
    token = _SPAN.set(True)
    try:
        yield
    finally:
        _SPAN.reset(token)


@contextmanager
def books(why: str) -> Iterator[None]:
    """A stretch of the span that must bring a value to the host to decide something.

    Args:
        why: what is decided there (it documents the call site; docs/architecture.md lists each).
    """
    del why  # read where it is written: the call site says what waits for the host, and why
    token = _SPAN.set(False)
    try:
        yield
    finally:
        _SPAN.reset(token)


def answered() -> None:
    """The answer boundary: a decode's first chosen token id is about to reach the host (to be
    turned into text). The rest of the enclosing `critical_path` is off the span."""
    _SPAN.set(False)


def on_critical_path() -> bool:
    """Whether the caller runs inside an op's span from its forward to its answer."""
    return _SPAN.get()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: from a host tensor to an accelerator, staged in pinned memory
    and copied without making the host wait (a copy from pageable memory would); else ``.to``.

    Safe to reuse or drop the host tensor at once: the pinned stage is the caching host
    allocator's, which keeps it until the copy is done."""
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
