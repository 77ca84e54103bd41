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
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from rich.progress import Progress, TaskID

from kamera_agent.backends.transformers_backend import TransformersBackend
from kamera_agent.bench.common import finite, median_seconds
from kamera_agent.models.tiny_tokenizer import build_byte_tokenizer
from kamera_agent.operator import ChunkKV, Patch, apply_patch, form_patch, read_chunk, to_position_free

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
        relocate_ms: the relocate-and-patch part of ``reuse_ms``.
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
    relocate_ms: float
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
            derived = {"ratio": row.ratio, "break_even": row.break_even}
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
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=32768,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
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
    reprefill_s, (full_cache, truth) = median_seconds(
        lambda: backend.forward_tokens(everything, torch.arange(everything.numel()), backend.assemble([])),
        shape.repeats,
        warmup=warm,
    )
    progress.advance(task)
    before = shape.anchor + shape.antecedent
    conditioned = read_chunk(
        full_cache, layout, before, before + tokens, torch.arange(before, before + tokens)
    )
    canonical_s, (anchor_kv, canonical) = median_seconds(
        lambda: _canonical(backend, anchor, chunk), 1, warmup=False
    )
    _, ante_canonical = _canonical(backend, anchor, ante)
    progress.advance(task)
    patches, form_ms = _form_patches(canonical, conditioned, backend, shape, progress, task)
    reuse = _Reuse(backend, anchor_kv, ante_canonical, canonical, query, shape)
    patch = patches[shape.reuse_rank]
    relocate_s, _ = median_seconds(lambda: reuse.relocate(patch), shape.repeats * 3)
    reuse_s, _ = median_seconds(lambda: reuse.first_logits(patch), shape.repeats * 3)
    exact = reuse.first_logits(form_patch(canonical, conditioned, layout, "full"))
    progress.advance(task)
    assert truth is not None
    return CostRow(
        tokens=tokens,
        reprefill_ms=reprefill_s * 1e3,
        reuse_ms=reuse_s * 1e3,
        relocate_ms=relocate_s * 1e3,
        canonical_ms=canonical_s * 1e3,
        kv_bytes=canonical.nbytes,
        patch_bytes={rank: patch.nbytes for rank, patch in patches.items()},
        form_ms=form_ms,
        reuse_rank=shape.reuse_rank,
        full_rank_logit_error=float((exact - truth).abs().max()),
    )


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

    def relocate(self, patch: Patch) -> list[ChunkKV]:
        layout, start = self.backend.layout, self.shape.anchor
        ante = apply_patch(
            self.antecedent, None, layout, torch.arange(start, start + self.antecedent.num_tokens)
        )
        start += self.antecedent.num_tokens
        chunk = apply_patch(self.chunk, patch, layout, torch.arange(start, start + self.chunk.num_tokens))
        return [self.anchor_kv, ante, chunk]

    def first_logits(self, patch: Patch) -> torch.Tensor:
        placed = self.relocate(patch)
        end = sum(kv.num_tokens for kv in placed)
        positions = torch.arange(end, end + self.query.numel())
        _, last = self.backend.forward_tokens(self.query, positions, self.backend.assemble(placed))
        assert last is not None
        return last
