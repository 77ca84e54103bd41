"""Can a window measure what an approximation does to the answer, without re-prefilling?

Why: the drift budget judges relative KV error, and on real models that does not tell harmful
drift from harmless (`answer_estimate.py`: no rescaling of the audits predicts the answer's KL;
`replay_frontier.py`: agents' drops that keep every first token measure KV errors as large as
the episodes' harmful ones). What a user sees is the answer, and a window that serves a request
knows its question. An audit already recomputes a random share of each approximated chunk's
rows exactly over its left; the answer decoded with those rows put back moves toward the
re-prefill's by about that share (logits are near-linear in small KV changes), so the change,
scaled up by the share, estimates the answer's whole change for the price of one more decode.

Each episode: ``--chunks`` passages of the benchmark half of kamera's corpus, prefilled in one
forward behind the anchor; the first leaves; the new lead is re-formed over the anchor; the
others keep their KV, relocated (what the planner's ``survivors="keep"`` does). Per ``--shares``:
each survivor's audit rows (`audit_indices`; ``--rows head``: as many from its start, the rows a
slide's repair buys most answer with, `slide_repair.py`) recomputed over the chunks to its left
as they then are, the answer to the corpus question decoded over that window, and the estimate
``KL(kept + (probed − kept) / share ‖ kept)``. Judged against the true ``KL(re-prefill ‖ kept)``:
Spearman over the slides, the ratio of true to estimated KL, and whether an estimate under a
threshold ever stood for a flipped first token; beside the KV-unit signal (the largest
survivor's relative error against the re-prefill, what a perfect audit would see).

    .venv/bin/python benchmarks/answer_probe.py --model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --json docs/results/calibration/answer-probe-smollm2.json
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from rich.table import Table

from kamera_agent.backends.base import Backend
from kamera_agent.bench.calibration_fit import _spearman
from kamera_agent.bench.common import machine_info, show_and_save
from kamera_agent.bench.slides import answer_logits, kept_slide, over_slides
from kamera_agent.divergence import next_token_kl
from kamera_agent.fidelity import audit_count, audit_indices, relative_error
from kamera_agent.loading import load_backend
from kamera_agent.settings import configure_threads

THRESHOLDS = (1e-3, 3e-3, 1e-2)
"""Estimated-KL thresholds a budget in answer units might hold ops to: at each, how many slides'
estimates fell under it, and their true KL and first tokens."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a text model: checkpoint folder or GGUF file")
    parser.add_argument("--seeds", type=int, default=24, help="episodes (seeds 1..N of the corpus order)")
    parser.add_argument("--chunks", type=int, default=6, help="passages before the slide (one leaves)")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument(
        "--rows",
        choices=("audit", "head"),
        default="audit",
        help="which rows of each survivor: the audit's random draw, or the contiguous run from its start",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    backend = load_backend(args.model)
    slides = over_slides(
        args.seeds, args.chunks, lambda texts, seed: slide(backend, texts, args.shares, str(seed), args.rows)
    )
    report: dict[str, Any] = {
        "model": str(args.model),
        "seeds": args.seeds,
        "chunks": args.chunks,
        "rows": args.rows,
    }
    report |= {"threads": args.threads, "machine": machine_info(), "slides": slides}
    report["shares"] = {str(share): judged(slides, str(share)) for share in args.shares}
    report["kv_signal"] = {"spearman": _spearman([s["kv_error"] for s in slides], [s["kl"] for s in slides])}
    return show_and_save(table(report), report, args.json)


def slide(
    backend: Backend, texts: Sequence[str], shares: Sequence[float], seed: str, rows_from: str = "audit"
) -> dict[str, Any]:
    """One slide: the kept window's answer against the re-prefill's, and each share's estimate."""
    one = kept_slide(backend, texts)
    root, survivors, starts, end, exact = one.root, one.survivors, one.starts, one.end, one.exact
    lead, kept, query = one.lead, one.kept_kv, one.query
    truth = answer_logits(backend, [root, *exact], query, end)
    served = answer_logits(backend, [root, lead, *kept], query, end)
    errors = [relative_error(got, want) for got, want in zip(kept, exact[1:], strict=True)]
    out: dict[str, Any] = {"kl": next_token_kl(truth, served), "agrees": _top(truth) == _top(served)}
    out |= {"kv_error": max(errors), "tokens": sum(c.num_tokens for c in survivors), "estimates": {}}
    for share in shares:
        probed, rows = [lead], 0
        for chunk, kv, start in zip(survivors[1:], kept, starts[1:], strict=True):
            if rows_from == "head":
                indices = torch.arange(audit_count(chunk.num_tokens, share))
            else:
                indices = audit_indices(chunk.num_tokens, share, f"{seed}:{start}")
            probed.append(backend.recompute(chunk, kv, indices, [root, *probed], start).kv[0])
            rows += int(indices.numel())
        moved = answer_logits(backend, [root, *probed], query, end)
        scale = sum(c.num_tokens for c in survivors[1:]) / rows  # the share the audits recomputed
        estimate = next_token_kl(served + scale * (moved - served), served)
        moved_kl = next_token_kl(moved, served)
        out["estimates"][str(share)] = {"kl": estimate, "rows": rows, "moved_kl": moved_kl}
    return out


def _top(logits: torch.Tensor) -> int:
    return int(logits.argmax())


def judged(slides: list[dict[str, Any]], share: str) -> dict[str, Any]:
    """How one share's estimates track the true KL over the slides."""
    estimated = [s["estimates"][share]["kl"] for s in slides]
    true = [s["kl"] for s in slides]
    ratios = sorted(t / max(e, 1e-12) for t, e in zip(true, estimated, strict=True))
    under = {}
    for threshold in THRESHOLDS:
        picked = [s for s, e in zip(slides, estimated, strict=True) if e <= threshold]
        under[str(threshold)] = {
            "slides": len(picked),
            "agreement": statistics.fmean(s["agrees"] for s in picked) if picked else None,
            "kl_max": max((s["kl"] for s in picked), default=None),
        }
    rows = statistics.fmean(s["estimates"][share]["rows"] / s["tokens"] for s in slides)
    return {
        "spearman": _spearman(estimated, true),
        "ratio_median": statistics.median(ratios),
        "ratio_max": ratios[-1],
        "under": under,
        "rows_share": rows,
    }


def table(report: dict[str, Any]) -> Table:
    out = Table(title=f"The answer's KL estimated from {report['rows']} rows: {report['seeds']} slides")
    columns = ("estimate", "Spearman vs true KL", "true / estimate (median, max)", "rows recomputed")
    columns += tuple(f"≤ {t:g}: slides, top-1" for t in THRESHOLDS)
    for column in columns:
        out.add_column(column, justify="left" if column == "estimate" else "right")
    for share, row in report["shares"].items():
        cells = [f"{report['rows']} rows, share {share}", f"{row['spearman']:.2f}"]
        cells += [f"{row['ratio_median']:.2f}, {row['ratio_max']:.2f}", f"{100 * row['rows_share']:.0f} %"]
        for threshold in THRESHOLDS:
            at = row["under"][str(threshold)]
            agreement = "—" if at["agreement"] is None else f"{100 * at['agreement']:.0f} %"
            cells.append(f"{at['slides']}, {agreement}")
        out.add_row(*cells)
    kv = report["kv_signal"]["spearman"]
    out.add_row("largest KV error (perfect audit)", f"{kv:.2f}", *["—"] * (len(columns) - 2))
    return out


if __name__ == "__main__":
    main()
