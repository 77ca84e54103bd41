"""Cost suite: time to first token of a query after reuse versus after re-prefill, side by side.

Why TTFT: an agent waits for the first token after every window edit. A prefix-cache miss
re-prefills ``anchor + antecedent + chunk + query``; kamera relocates the stored canonicals,
adds the chunk's rank-16 patch, assembles the cache and prefills only the query. Both run
through the backend's own code path, alternately, on one model in one process; only the
ratio of figures measured together is meaningful on a noisy machine.

Also per chunk length: canonical KV bytes, patch bytes per rank, the patch-forming cost (the
SVD: the conditioned forward is the one a first admission pays anyway) and the break-even
number of reuses. The model is a random-init slice of a 1.5B-class Qwen2 (GQA): timing does
not depend on the weights' values.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from rich.progress import Progress, TaskID

from kamera_agent.backends.transformers import TransformersBackend, read_chunk
from kamera_agent.bench.common import finite, median_seconds
from kamera_agent.models.random_qwen2 import Qwen2Shape, random_qwen2
from kamera_agent.operator import ChunkKV, Patch, apply_patch, form_patch, to_position_free

__all__ = ["CostRow", "CostRun", "CostShape", "run_cost"]


@dataclass(frozen=True)
class CostShape:
    """The model slice and the token layout timed (default: 8 layers of a 1.5B-class Qwen2)."""

    layers: int = 8
    hidden: int = 1536
    heads: int = 12
    kv_heads: int = 2
    mlp: int = 8960
    vocab: int = 32000
    anchor: int = 16
    antecedent: int = 256
    query: int = 16
    lengths: tuple[int, ...] = (256, 512, 1024, 2048)
    ranks: tuple[int, ...] = (4, 8, 16, 32, 64)
    reuse_rank: int = 16
    repeats: int = 3

    @classmethod
    def quick(cls) -> CostShape:
        """Toy sizes for smoke runs: 2 layers, hidden 64, chunks of 32 and 64 tokens."""
        return cls(
            layers=2,
            hidden=64,
            heads=4,
            kv_heads=2,
            mlp=128,
            vocab=512,
            antecedent=32,
            query=8,
            lengths=(32, 64),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class CostRow:
    """One chunk length: the two TTFTs, bytes, forming cost and break-even.

    Attributes:
        tokens: chunk length.
        reprefill_ms: TTFT after re-prefilling anchor + antecedent + chunk + query.
        reuse_ms: TTFT after relocate + rank-``reuse_rank`` patch + assemble + query prefill.
        restore_ms: the context part of ``reuse_ms``: relocate + patch + assemble the cache (the
            rest is the query's own prefill, which re-prefill pays too).
        canonical_ms: the chunk's prefill behind the anchor alone (how its canonical is made).
        kv_bytes: the chunk's canonical KV bytes.
        patch_bytes: bytes of a patch per rank.
        form_ms: forming a patch per rank (the SVD of the deficit).
        full_rank_logit_error: max |logit difference| of reuse with a full-rank patch against
            re-prefill: the timed path is an exact path.
    """

    tokens: int
    reprefill_ms: float
    reuse_ms: float
    restore_ms: float
    canonical_ms: float
    kv_bytes: int
    patch_bytes: dict[int, int]
    form_ms: dict[int, float]
    reuse_rank: int
    full_rank_logit_error: float

    @property
    def ratio(self) -> float:
        """How many times faster the first token comes after reuse than after re-prefill."""
        return self.reprefill_ms / self.reuse_ms

    @property
    def query_ms(self) -> float:
        """The query's own prefill over the restored cache (``reuse_ms`` less ``restore_ms``)."""
        return max(0.0, self.reuse_ms - self.restore_ms)

    @property
    def saved_ms(self) -> float:
        return self.reprefill_ms - self.reuse_ms

    @property
    def break_even(self) -> float:
        """Reuses that pay for forming the patch (its SVD), each saving ``saved_ms``."""
        return self.form_ms[self.reuse_rank] / self.saved_ms if self.saved_ms > 0 else math.inf

    @property
    def break_even_with_canonical(self) -> float:
        """As `break_even`, also charging the canonical's own prefill (which a prefix cache skips)."""
        spent = self.form_ms[self.reuse_rank] + self.canonical_ms
        return spent / self.saved_ms if self.saved_ms > 0 else math.inf


@dataclass
class CostRun:
    """The suite's live state: a row per finished chunk length (``quick``: toy sizes, whose
    timings are per-call overhead and say nothing about the targets)."""

    shape: CostShape
    threads: int
    quick: bool = False
    rows: list[CostRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        rows = []
        for row in self.rows:
            derived = {"ratio": row.ratio, "query_ms": row.query_ms, "break_even": row.break_even}
            derived["break_even_with_canonical"] = row.break_even_with_canonical
            rows.append({**vars(row), **{k: finite(v) for k, v in derived.items()}})
        return {"shape": vars(self.shape), "threads": self.threads, "quick": self.quick, "rows": rows}


def run_cost(run: CostRun, progress: Progress, seed: int) -> None:
    """Time every chunk length of ``run.shape``.

    Mutates: ``run.rows`` (one row per finished length).
    """
    shape = run.shape
    backend = _backend(shape, seed)
    steps = 3 + len(shape.ranks)
    task = progress.add_task("cost · TTFT reuse vs re-prefill", total=steps * len(shape.lengths))
    for index, tokens in enumerate(shape.lengths):
        run.rows.append(
            _measure(backend, replace(shape, lengths=(tokens,)), seed, progress, task, index == 0)
        )


def _backend(shape: CostShape, seed: int) -> TransformersBackend:
    from kamera_agent.models.tiny_tokenizer import build_byte_tokenizer

    model_shape = Qwen2Shape(shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.mlp, shape.vocab)
    model = random_qwen2(model_shape, seed=seed, max_positions=32768)
    return TransformersBackend(model, tokenizer=build_byte_tokenizer(vocab_size=shape.vocab))


def _measure(
    backend: TransformersBackend, shape: CostShape, seed: int, progress: Progress, task: TaskID, warm: bool
) -> CostRow:
    """One length: re-prefill (which also yields the conditioned KV), canonicals, patches, reuse."""
    tokens, layout = shape.lengths[0], backend.layout
    gen = torch.Generator().manual_seed(seed + tokens)
    anchor, ante, chunk, query = (
        torch.randint(0, shape.vocab, (n,), generator=gen)
        for n in (shape.anchor, shape.antecedent, tokens, shape.query)
    )
    everything = torch.cat([anchor, ante, chunk, query])

    def reprefill() -> tuple[Any, torch.Tensor | None]:
        return backend.forward_tokens(everything, torch.arange(everything.numel()), backend.assemble([]))

    first_s, (full_cache, truth) = median_seconds(reprefill, 1, warmup=warm)
    progress.advance(task)
    before = shape.anchor + shape.antecedent
    at = torch.arange(before, before + tokens)
    conditioned = read_chunk(full_cache, layout, before, before + tokens, at)
    canonical_s, (anchor_kv, canonical) = median_seconds(
        lambda: _canonical(backend, anchor, chunk), 1, warmup=False
    )
    _, ante_canonical = _canonical(backend, anchor, ante)
    progress.advance(task)
    patches, form_ms = _form_patches(canonical, conditioned, backend, shape, progress, task)
    reuse = _Reuse(backend, anchor_kv, ante_canonical, canonical, query, shape, patches[shape.reuse_rank])
    reprefill_s, reuse_s = _side_by_side(reprefill, reuse.first_logits, shape.repeats, [first_s])
    restore_s, _ = median_seconds(reuse.restore, shape.repeats * 3)
    exact = replace(reuse, patch=form_patch(canonical, conditioned, layout, "full")).first_logits()
    progress.advance(task)
    assert truth is not None
    return CostRow(
        tokens=tokens,
        reprefill_ms=reprefill_s * 1e3,
        reuse_ms=reuse_s * 1e3,
        restore_ms=restore_s * 1e3,
        canonical_ms=canonical_s * 1e3,
        kv_bytes=canonical.nbytes,
        patch_bytes={rank: patch.nbytes for rank, patch in patches.items()},
        form_ms=form_ms,
        reuse_rank=shape.reuse_rank,
        full_rank_logit_error=float((exact - truth).abs().max()),
    )


def _side_by_side(
    reprefill: Callable[[], object], reuse: Callable[[], object], repeats: int, slow: list[float]
) -> tuple[float, float]:
    """Median seconds of both, from alternating runs (each re-prefill followed by three reuses)
    so that both see the same machine state; ``slow`` holds re-prefill samples already taken."""
    reuse()  # warm-up: the first assemble and query prefill at this length
    fast: list[float] = []
    for round_ in range(repeats):
        if round_ >= len(slow):
            slow.append(median_seconds(reprefill, 1, warmup=False)[0])
        fast += [median_seconds(reuse, 1, warmup=False)[0] for _ in range(3)]
    return statistics.median(slow), statistics.median(fast)


def _form_patches(
    canonical: ChunkKV,
    conditioned: ChunkKV,
    backend: TransformersBackend,
    shape: CostShape,
    progress: Progress,
    task: TaskID,
) -> tuple[dict[int, Patch], dict[int, float]]:
    """A patch per rank and the milliseconds its SVD took (the median of ``shape.repeats``)."""
    patches: dict[int, Patch] = {}
    form_ms: dict[int, float] = {}
    for rank in shape.ranks:
        seconds, patches[rank] = median_seconds(
            lambda r=rank: form_patch(canonical, conditioned, backend.layout, r),  # type: ignore[misc]
            shape.repeats,
        )
        form_ms[rank] = seconds * 1e3
        progress.advance(task)
    return patches, form_ms


def _canonical(
    backend: TransformersBackend, anchor: torch.Tensor, chunk: torch.Tensor
) -> tuple[ChunkKV, ChunkKV]:
    """(anchor KV at 0, the chunk's position-free canonical): one prefill of anchor + chunk."""
    ids = torch.cat([anchor, chunk])
    cache, _ = backend.forward_tokens(ids, torch.arange(ids.numel()), backend.assemble([]), logits=False)
    n_anchor, layout = int(anchor.numel()), backend.layout
    anchor_kv = read_chunk(cache, layout, 0, n_anchor, torch.arange(n_anchor))
    placed = read_chunk(cache, layout, n_anchor, ids.numel(), torch.arange(n_anchor, ids.numel()))
    return anchor_kv, to_position_free(placed, layout)


@dataclass(frozen=True)
class _Reuse:
    """The reuse path: antecedent and chunk relocated behind the anchor, the chunk patched."""

    backend: TransformersBackend
    anchor_kv: ChunkKV
    antecedent: ChunkKV
    chunk: ChunkKV
    query: torch.Tensor
    shape: CostShape
    patch: Patch

    def relocate(self) -> list[ChunkKV]:
        """Both stored chunks placed behind the anchor (relocation + the chunk's patch)."""
        layout, start = self.backend.layout, self.shape.anchor
        middle = start + self.antecedent.num_tokens
        ante_at = torch.arange(start, middle)
        chunk_at = torch.arange(middle, middle + self.chunk.num_tokens)
        ante = apply_patch(self.antecedent, None, layout, ante_at)
        return [self.anchor_kv, ante, apply_patch(self.chunk, self.patch, layout, chunk_at)]

    def restore(self) -> Any:
        """The window's cache, ready for the query: relocate, patch, assemble."""
        return self.backend.assemble(self.relocate())

    def first_logits(self) -> torch.Tensor:
        """TTFT's work: restore the cache, prefill the query, the first token's logits."""
        cache = self.restore()
        end = self.shape.anchor + self.antecedent.num_tokens + self.chunk.num_tokens
        positions = torch.arange(end, end + self.query.numel())
        _, last = self.backend.forward_tokens(self.query, positions, cache)
        assert last is not None
        return last
