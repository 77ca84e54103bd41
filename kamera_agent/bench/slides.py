"""A slide of corpus passages at the KV level: the lead leaves, the new lead is re-formed over
the anchor, the others keep their KV relocated, beside the survivors' exact re-prefill.

Why shared: the benchmarks that judge what a slide's kept survivors do to the answer
(`benchmarks/slide_repair.py` repairs them, `benchmarks/answer_probe.py` estimates their effect)
build the same episode over the same seeds and read the same answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from rich.progress import Progress

from kamera_agent.backends.base import Backend, DecodeConfig
from kamera_agent.bench.corpus import QUESTION, passages
from kamera_agent.chunks import Chunk
from kamera_agent.operator import ChunkKV, relocate, to_position_free

__all__ = ["KeptSlide", "answer_logits", "kept_slide", "over_slides"]


@dataclass(frozen=True)
class KeptSlide:
    """One slide's pieces (positions from the anchor on)."""

    root: ChunkKV
    """The anchor's KV."""
    survivors: list[Chunk]
    """The chunks left once the lead left, the new lead first."""
    starts: list[int]
    """Where each survivor starts."""
    end: int
    """The position after the last survivor (where the question starts)."""
    exact: list[ChunkKV]
    """The survivors re-prefilled behind the anchor: the truth."""
    lead: ChunkKV
    """The new lead re-formed behind the anchor alone (its canonical, exact there)."""
    kept_kv: list[ChunkKV]
    """The other survivors' KV from before the slide (what they absorbed of the lead kept),
    relocated to their new starts."""
    query: torch.Tensor
    """The corpus question's ids."""


def kept_slide(backend: Backend, texts: Sequence[str]) -> KeptSlide:
    """``texts`` prefilled in one forward behind the anchor, then the first slid out."""
    enc = backend.encoder
    anchor = enc.anchor()
    root = backend.prefill([anchor], [], 0).kv[0]
    chunks = [enc.text(text) for text in texts]
    before = backend.prefill(chunks, [root], anchor.advance).kv
    survivors = chunks[1:]
    starts = [anchor.advance + sum(c.advance for c in survivors[:i]) for i in range(len(survivors))]
    end = starts[-1] + survivors[-1].advance
    exact = list(backend.prefill(survivors, [root], anchor.advance).kv)
    lead = backend.prefill(survivors[:1], [root], anchor.advance).kv[0]
    layout = backend.layout
    kept_kv = [
        relocate(to_position_free(kv, layout), layout, c.positions_at(s))
        for kv, c, s in zip(before[2:], survivors[1:], starts[1:], strict=True)
    ]
    return KeptSlide(root, survivors, starts, end, exact, lead, kept_kv, enc.query_ids(*QUESTION))


def answer_logits(backend: Backend, placed: list[ChunkKV], query: torch.Tensor, end: int) -> torch.Tensor:
    """The first answer token's logits for ``query`` after ``placed`` (which ends at ``end``)."""
    decoded = backend.decode(backend.assemble(placed), query, end, DecodeConfig(max_new_tokens=1))
    return decoded.answer.first_logits.float().flatten()


def over_slides(
    seeds: int, chunks: int, measure: Callable[[list[str], int], dict[str, Any]]
) -> list[dict[str, Any]]:
    """``measure(texts, seed)`` for seeds 1..``seeds``, each on ``chunks`` passages of the benchmark
    half of the corpus (disjoint from the calibration's), with a progress bar."""
    out = []
    with Progress() as progress:
        task = progress.add_task("slides", total=seeds)
        for seed in range(1, seeds + 1):
            out.append(measure(passages("benchmark", seed, chunks), seed))
            progress.advance(task)
    return out
