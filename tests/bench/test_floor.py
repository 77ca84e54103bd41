"""The numerical floor's bf16 emulation: rounding where a bf16 model rounds, at fp32's cost."""

from __future__ import annotations

import torch

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.floor import Floor
from tests.window.backends import backend_named


def _first_logits(backend: TransformersBackend, emulate: bool | None) -> torch.Tensor:
    """The first-token logits of a fixed window: fp32 (``None``), bf16, or bf16 emulated."""
    chunks = [backend.encoder.text(text) for text in ("the quick brown fox", "jumps over the lazy dog")]
    query = backend.encoder.query_ids("What jumped?")
    if emulate is None:
        return backend.reference_prefill(chunks, query).logits
    floor = Floor(backend, torch.bfloat16, emulate=emulate)
    floor.sync(chunks)
    return floor.first_logits(query)


def test_the_emulated_floor_moves_the_answer_as_far_as_bf16_does_computing_in_fp32() -> None:
    backend = backend_named("qwen2")
    assert isinstance(backend, TransformersBackend)
    exact, cast, emulated = (_first_logits(backend, emulate) for emulate in (None, False, True))
    floor = Floor(backend, torch.bfloat16, emulate=True)
    assert all(p.dtype == torch.float32 for p in floor.model.parameters())  # fp32 arithmetic
    assert backend.model.dtype == torch.float32  # the backend's own model untouched
    held: list[torch.Tensor] = []  # what a projection hands on: bf16's precision, in fp32
    projection = next(m for m in floor.model.modules() if isinstance(m, torch.nn.Linear))
    projection.register_forward_hook(lambda module, args, out: held.append(out))
    floor.sync([backend.encoder.text("the quick brown fox")])
    floor.first_logits(backend.encoder.query_ids("What?"))
    assert held and torch.equal(held[0], held[0].to(torch.bfloat16).float())
    # a different rounding noise than the cast's (kernels accumulate in their own order), of its size
    for statistic in (torch.mean, torch.amax):
        moved, cast_moved = (float(statistic((exact - other).abs())) for other in (emulated, cast))
        assert 0.5 < moved / cast_moved < 2
