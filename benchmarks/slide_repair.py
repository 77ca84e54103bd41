"""Which repair of the survivors of a slide buys the most answer fidelity per token?

Why: after the lead chunk leaves, every survivor's KV still encodes it. The drift budget's
ladder re-forms the new lead (the attention sink) and keeps the rest, or fixes the first chunk
over ε by recomputing its most deviating tokens (CacheBlend's rule: a one-layer probe picks
them), by re-prefilling it alone, or by re-prefilling from it. Prior art on document edits
("Contiguity, Not Importance", arXiv 2609.17983) finds that recomputing a contiguous run of
tokens right after the change recovers more than picking tokens by importance. This measures
both rules on a real model, each applied to every kept survivor left to right (the ones to its
left already repaired), at equal shares of their tokens, beside keeping them and beside the
model's own re-prefill in bf16 (the noise a deployment in that precision accepts).

Each episode: ``--chunks`` passages of the benchmark half of kamera's corpus, prefilled in one
forward behind the anchor; the first leaves; the new lead is re-formed over the anchor; the
others are relocated to their new positions (exact: RoPE is position-linear) and repaired by
each rule. Reported per rule: the next-token KL of the corpus question's answer against the
fp32 re-prefill of the survivors, the share of first answer tokens equal, each survivor's
relative KV error by its distance from the change, and the tokens the repair prefilled (the
deviation probe counted as its share of a forward).

    .venv/bin/python benchmarks/slide_repair.py --model SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/python benchmarks/slide_repair.py --model gemma-3-270m-q4_k_m.gguf --seeds 24 \\
        --json docs/results/gemma3-slide-repair.json
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from rich.progress import Progress
from rich.table import Table

from kamera_agent.backends.base import Backend
from kamera_agent.backends.recompute import deviation_spent
from kamera_agent.bench.common import machine_info, show_and_save
from kamera_agent.bench.corpus import passages
from kamera_agent.bench.slides import answer_logits, kept_slide
from kamera_agent.chunks import Chunk
from kamera_agent.core import select_tokens
from kamera_agent.divergence import next_token_kl
from kamera_agent.fidelity import relative_error
from kamera_agent.loading import load_backend
from kamera_agent.operator import ChunkKV
from kamera_agent.settings import configure_threads

Pick = Callable[[Backend, Chunk, ChunkKV, list[ChunkKV], int], tuple[torch.Tensor, int]]
"""A repair rule: the token indices of a kept survivor to recompute, and the tokens its picking
cost (the chunk, its kept KV placed at its start, the repaired context to its left, the start)."""


@dataclass(frozen=True)
class Rule:
    name: str
    pick: Pick | None  # None: kept as it is
    first_only: bool = False  # only the survivor right after the re-formed lead


def head(share: float) -> Pick:
    """The contiguous run of ``share`` of the chunk's tokens from its start."""

    def pick(
        backend: Backend, chunk: Chunk, kv: ChunkKV, left: list[ChunkKV], start: int
    ) -> tuple[torch.Tensor, int]:
        return torch.arange(math.ceil(share * chunk.num_tokens)), 0

    return pick


def deviating(share: float) -> Pick:
    """``share`` of the chunk's tokens with the largest one-layer deviation (CacheBlend's rule)."""

    def pick(
        backend: Backend, chunk: Chunk, kv: ChunkKV, left: list[ChunkKV], start: int
    ) -> tuple[torch.Tensor, int]:
        scores = backend.deviation(chunk, kv, left, start, None, 1).scores
        probe = deviation_spent(chunk.num_tokens, 1, backend.layout.num_layers).tokens_prefilled
        return select_tokens(scores, share), probe

    return pick


RULES = (
    Rule("kept", None),
    Rule("deviating 15 %", deviating(0.15)),
    Rule("deviating 30 %", deviating(0.30)),
    Rule("head 10 %", head(0.10)),
    Rule("head 15 %", head(0.15)),
    Rule("head 30 %", head(0.30)),
    Rule("head 50 %", head(0.50)),
    Rule("head 30 %, first only", head(0.30), first_only=True),
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a text model: checkpoint folder or GGUF file")
    parser.add_argument("--seeds", type=int, default=24, help="episodes (seeds 1..N of the corpus order)")
    parser.add_argument("--chunks", type=int, default=6, help="passages before the slide (one leaves)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    configure_threads(None)
    backend = load_backend(args.model)
    floor = load_backend(args.model, dtype=torch.bfloat16)
    rows: dict[str, dict[str, list[Any]]] = {}
    with Progress() as progress:
        task = progress.add_task("slides", total=args.seeds)
        for seed in range(1, args.seeds + 1):
            texts = passages("benchmark", seed, args.chunks)
            for name, figures in episode(backend, floor, texts).items():
                row = rows.setdefault(name, {"kl": [], "agrees": [], "errors": [], "tokens": []})
                for key, value in figures.items():
                    row[key].append(value)
            progress.advance(task)
    report = {"model": str(args.model), "seeds": args.seeds, "chunks": args.chunks, "machine": machine_info()}
    report["rules"] = {name: summary(row) for name, row in rows.items()}
    return show_and_save(table(report), report, args.json)


def episode(backend: Backend, floor: Backend, texts: Sequence[str]) -> dict[str, dict[str, Any]]:
    """One slide's repairs, each judged against the survivors' fp32 re-prefill."""
    one = kept_slide(backend, texts)
    root, survivors, starts, end, exact = one.root, one.survivors, one.starts, one.end, one.exact
    lead, kept, query = one.lead, one.kept_kv, one.query
    truth = answer_logits(backend, [root, *exact], query, end)
    out: dict[str, dict[str, Any]] = {}
    for rule in RULES:
        repaired, tokens = [lead], lead.num_tokens
        for i, (chunk, kv) in enumerate(zip(survivors[1:], kept, strict=True)):
            if rule.pick is not None and (i == 0 or not rule.first_only):
                indices, probe = rule.pick(backend, chunk, kv, [root, *repaired], starts[i + 1])
                kv = backend.recompute(chunk, kv, indices, [root, *repaired], starts[i + 1], None).kv[0]
                tokens += probe + int(indices.numel())
            repaired.append(kv)
        out[rule.name] = judged(backend, [root, *repaired], exact, query, end, truth, tokens)
    anchor = backend.encoder.anchor()
    floor_root = floor.prefill([anchor], [], 0).kv[0]
    floor_kv = [floor_root, *floor.prefill(survivors, [floor_root], anchor.advance).kv]
    out["bf16 re-prefill"] = judged(floor, floor_kv, exact, query, end, truth, exact_tokens(survivors))
    out["re-prefill"] = judged(backend, [root, *exact], exact, query, end, truth, exact_tokens(survivors))
    return out


def exact_tokens(survivors: Sequence[Chunk]) -> int:
    return sum(c.num_tokens for c in survivors)


def judged(
    backend: Backend,
    placed: list[ChunkKV],
    exact: list[ChunkKV],
    query: torch.Tensor,
    end: int,
    truth: torch.Tensor,
    tokens: int,
) -> dict[str, Any]:
    logits = answer_logits(backend, placed, query, end)
    errors = [relative_error(got, want) for got, want in zip(placed[2:], exact[1:], strict=True)]
    agrees = int(logits.argmax()) == int(truth.argmax())
    return {"kl": next_token_kl(truth, logits), "agrees": agrees, "errors": errors, "tokens": tokens}


def summary(row: dict[str, list[Any]]) -> dict[str, Any]:
    by_distance = list(zip(*row["errors"], strict=True))
    return {
        "kl_mean": statistics.fmean(row["kl"]),
        "kl_median": statistics.median(row["kl"]),
        "kl_max": max(row["kl"]),
        "agreement": statistics.fmean(row["agrees"]),
        "error_by_distance": [statistics.fmean(errors) for errors in by_distance],
        "tokens_mean": statistics.fmean(row["tokens"]),
    }


def table(report: dict[str, Any]) -> Table:
    rules = report["rules"]
    refill = rules["re-prefill"]["tokens_mean"]
    out = Table(title=f"A slide's survivors repaired: {report['seeds']} slides, {report['chunks']} passages")
    columns = ("repair", "tokens / re-prefill", "KL mean", "KL median", "KL max", "top-1", "error first→last")
    for column in columns:
        out.add_column(column, justify="left" if column == "repair" else "right")
    for name, row in rules.items():
        errors = f"{row['error_by_distance'][0]:.3f}→{row['error_by_distance'][-1]:.3f}"
        out.add_row(
            name,
            f"{row['tokens_mean'] / refill:.2f}",
            f"{row['kl_mean']:.1e}",
            f"{row['kl_median']:.1e}",
            f"{row['kl_max']:.1e}",
            f"{100 * row['agreement']:.1f} %",
            errors,
        )
    return out


if __name__ == "__main__":
    main()
