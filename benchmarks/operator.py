"""Operator benchmark: reuse (relocate + patch-apply) versus the model's own prefill.

Measured side by side in one run on one model (these machines are noisy, so only ratios
measured together count):

- time to prefill one chunk of ``--tokens`` tokens behind an anchor prefix (the forward a
  prefix-cache miss pays), versus relocating its stored canonical to new positions and adding
  a rank-m patch (what kamera pays on reuse), per rank;
- bytes of a patch per rank versus the chunk's KV bytes;
- the one-time cost of forming a patch (SVD of the deficit) and the break-even reuse count
  when the conditioned forward is the one a first admission pays anyway.

Default shape: 8 decoder layers of a 1.5B-class GQA model (hidden 1536, 12 heads, 2 KV heads,
head_dim 128, MLP 8960, Qwen2 layout), random init, float32 on CPU.

    python benchmarks/operator.py                       # 1024 tokens, ranks 8/16/32/64
    python benchmarks/operator.py --dtype bfloat16 --device cuda --layers 28 --hidden 3584 \
        --heads 28 --kv-heads 4 --mlp 18944          # 7B-class, where a GPU is lent
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kamera_agent.backends.transformers import kv_layout, read_chunk
from kamera_agent.compat import output_cache
from kamera_agent.models.random_qwen2 import Qwen2Shape, random_qwen2
from kamera_agent.operator import apply_patch, form_patch, to_position_free
from kamera_agent.settings import configure_threads


def build_model(args: argparse.Namespace) -> Any:
    shape = Qwen2Shape(args.layers, args.hidden, args.heads, args.kv_heads, args.mlp, args.vocab)
    return random_qwen2(shape, device=args.device, dtype=getattr(torch, args.dtype))


def timed(fn: Callable[[], Any], repeats: int, device: str) -> tuple[float, Any]:
    """Median seconds over ``repeats`` runs (after one warm-up), and the last result."""
    result = fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--prefix", type=int, default=16, help="anchor prefix tokens")
    parser.add_argument("--antecedent", type=int, default=256, help="tokens before the chunk")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--mlp", type=int, default=8960)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default $KAMERA_NUM_THREADS or 1)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    threads = configure_threads(args.threads)
    console = Console()

    model = build_model(args)
    layout = kv_layout(model)
    gen = torch.Generator().manual_seed(0)
    prefix, ante, chunk = (
        torch.randint(0, args.vocab, (n,), generator=gen) for n in (args.prefix, args.antecedent, args.tokens)
    )
    n_before = args.prefix + args.antecedent
    b_pos = torch.arange(n_before, n_before + args.tokens, device=args.device)

    def forward(ids: torch.Tensor) -> Any:
        ids = ids.to(args.device)
        with torch.no_grad():
            out = model(
                input_ids=ids[None],
                position_ids=torch.arange(ids.numel(), device=args.device)[None],
                use_cache=True,
            )
        return output_cache(out)

    console.print(
        f"[bold]operator benchmark[/bold] · {layout.kind} · {args.layers} layers · {args.dtype} · "
        f"{args.device} · {threads} threads"
    )
    # The prefill a prefix-cache miss pays: the chunk behind the anchor prefix.
    prefill_s, alone = timed(lambda: forward(torch.cat([prefix, chunk])), args.repeats, args.device)
    canonical = to_position_free(
        read_chunk(
            alone,
            layout,
            args.prefix,
            args.prefix + args.tokens,
            torch.arange(args.prefix, args.prefix + args.tokens, device=args.device),
        ),
        layout,
    )
    conditioned_s, full = timed(lambda: forward(torch.cat([prefix, ante, chunk])), 1, args.device)
    conditioned = read_chunk(full, layout, n_before, n_before + args.tokens, b_pos)

    relocate_s, _ = timed(lambda: apply_patch(canonical, None, layout, b_pos), args.repeats * 3, args.device)
    rows = []
    for rank in args.ranks:
        form_s, patch = timed(
            lambda rank=rank: form_patch(canonical, conditioned, layout, rank), 1, args.device
        )
        apply_s, _ = timed(
            lambda patch=patch: apply_patch(canonical, patch, layout, b_pos), args.repeats * 3, args.device
        )
        # Break-even: forming costs the SVD (the conditioned forward is paid by the first admission
        # anyway); each reuse then saves (prefill - apply).
        saved = prefill_s - apply_s
        rows.append(
            {
                "rank": rank,
                "apply_ms": apply_s * 1e3,
                "speedup_vs_prefill": prefill_s / apply_s,
                "patch_bytes": patch.nbytes,
                "patch_fraction_of_kv": patch.nbytes / canonical.nbytes,
                "form_ms": form_s * 1e3,
                "break_even_reuses": form_s / saved if saved > 0 else float("inf"),
            }
        )

    table = Table(
        title=f"{args.tokens}-token chunk: prefill {prefill_s * 1e3:.0f} ms, relocation only "
        f"{relocate_s * 1e3:.2f} ms ({prefill_s / relocate_s:.0f}x), "
        f"chunk KV {canonical.nbytes / 2**20:.1f} MiB"
    )
    for column in (
        "rank",
        "relocate+patch ms",
        "x faster than prefill",
        "patch MiB",
        "patch / KV",
        "form ms",
        "break-even reuses",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["rank"]),
            f"{row['apply_ms']:.2f}",
            f"{row['speedup_vs_prefill']:.0f}x",
            f"{row['patch_bytes'] / 2**20:.2f}",
            f"{row['patch_fraction_of_kv']:.1%}",
            f"{row['form_ms']:.0f}",
            f"{row['break_even_reuses']:.2f}",
        )
    console.print(table)
    result = {
        "machine": platform.platform(),
        "processor": platform.processor(),
        "torch": torch.__version__,
        "threads": threads,
        "args": vars(args),
        "prefill_ms": prefill_s * 1e3,
        "conditioned_forward_ms": conditioned_s * 1e3,
        "relocate_ms": relocate_s * 1e3,
        "chunk_kv_bytes": canonical.nbytes,
        "ranks": rows,
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
