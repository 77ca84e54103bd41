"""Repair a slide's kept survivors where it pays most, then judge what is left by the answer.

Why: a budget in KV units cannot tell a real model's harmless drops from harmful ones
(`replay_frontier.py`), and `answer_probe.py` found that the answer decoded with each survivor's
first rows recomputed moves toward the re-prefill's, by more per row than the share predicts
(those rows carry most of the drift: `slide_repair.py`). So recompute them, keep them (they are
exact over their left), and judge the window so repaired: extrapolate the move those rows made
to all of each survivor's rows (an over-estimate, as the rows after them drifted less) and let
the window stand only where the extrapolated answer keeps its first token and stays within a
KL threshold; elsewhere re-prefill. This measures that verdict against the truth, for two
probes: the corpus question (what a window knows when an op is part of a request) and a neutral
one, the end of a user turn and the assistant's opening (what every chat request decodes, so a
window can judge an op before it knows the question; a newline where the model frames no turns).

Each episode (as `answer_probe.py`): ``--chunks`` passages of the benchmark half of kamera's
corpus prefilled behind the anchor; the first leaves; the new lead is re-formed; the others keep
their KV, relocated, and have their first ``--shares`` of rows recomputed over their left as it
then stands. Per threshold, the verdict's policy over the slides: how many stand, the first
answer tokens equal to the re-prefill's and the mean KL (a refused slide is re-prefilled: equal,
KL 0), and the tokens prefilled against re-prefilling every slide's survivors.

    .venv/bin/python benchmarks/answer_judge.py --model SmolLM2-135M-Instruct.Q4_1.gguf \\
        --json docs/results/calibration/answer-judge-smollm2.json
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from rich.table import Table

from kamera_agent.backends.base import Backend
from kamera_agent.bench.common import machine_info, show_and_save
from kamera_agent.bench.slides import answer_logits, kept_slide, over_slides
from kamera_agent.divergence import next_token_kl
from kamera_agent.fidelity import audit_count
from kamera_agent.loading import load_backend
from kamera_agent.operator import ChunkKV
from kamera_agent.settings import configure_threads
from kamera_agent.window.answer_check import neutral_probe

THRESHOLDS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
"""Extrapolated residual KLs the verdict may hold a window to."""

PROBES = ("question", "neutral")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a text model: checkpoint folder or GGUF file")
    parser.add_argument("--seeds", type=int, default=48, help="episodes (seeds 1..N of the corpus order)")
    parser.add_argument("--chunks", type=int, default=6, help="passages before the slide (one leaves)")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    backend = load_backend(args.model)
    slides = over_slides(args.seeds, args.chunks, lambda texts, _: judge_slide(backend, texts, args.shares))
    report: dict[str, Any] = {"model": str(args.model), "seeds": args.seeds, "chunks": args.chunks}
    report |= {"threads": args.threads, "machine": machine_info(), "slides": slides}
    report["verdicts"] = {
        f"{share}:{probe}": {str(t): verdict(slides, str(share), probe, t) for t in THRESHOLDS}
        for share in args.shares
        for probe in PROBES
    }
    return show_and_save(table(report), report, args.json)


def judge_slide(backend: Backend, texts: list[str], shares: list[float]) -> dict[str, Any]:
    """One slide: the truth, the kept window, and per share the repaired window and its judging."""
    one = kept_slide(backend, texts)
    root, survivors, starts, end = one.root, one.survivors, one.starts, one.end
    probes = {"question": one.query, "neutral": neutral_probe(backend.encoder.query_ids)}
    truth = answer_logits(backend, [root, *one.exact], one.query, end)
    kept = [root, one.lead, *one.kept_kv]
    served = {name: answer_logits(backend, kept, ids, end) for name, ids in probes.items()}
    tokens = sum(c.num_tokens for c in survivors)
    out: dict[str, Any] = {
        "tokens": tokens,
        "lead": survivors[0].num_tokens,
        "kept": _judged(truth, served["question"]),
    }
    out["repaired"] = {}
    for share in shares:
        repaired: list[ChunkKV] = [one.lead]
        rows = 0
        for chunk, kv, start in zip(survivors[1:], one.kept_kv, starts[1:], strict=True):
            head = torch.arange(audit_count(chunk.num_tokens, share))
            repaired.append(backend.recompute(chunk, kv, head, [root, *repaired], start).kv[0])
            rows += int(head.numel())
        scale = sum(c.num_tokens for c in survivors[1:]) / rows
        placed = [root, *repaired]
        moved = {name: answer_logits(backend, placed, ids, end) for name, ids in probes.items()}
        judged = _judged(truth, moved["question"]) | {"rows": rows}
        for name in PROBES:
            guess = moved[name] + (scale - 1) * (moved[name] - served[name])
            judged[name] = {
                "residual": next_token_kl(guess, moved[name]),
                "top_holds": _top(guess) == _top(moved[name]),
            }
        out["repaired"][str(share)] = judged
    return out


def _judged(truth: torch.Tensor, served: torch.Tensor) -> dict[str, Any]:
    return {"kl": next_token_kl(truth, served), "agrees": _top(truth) == _top(served)}


def _top(logits: torch.Tensor) -> int:
    return int(logits.argmax())


def verdict(slides: list[dict[str, Any]], share: str, probe: str, threshold: float) -> dict[str, Any]:
    """The policy "stand where the extrapolated residual is within ``threshold`` and keeps the first
    token, else re-prefill the survivors" over the slides."""
    agrees, kls, spent, stood, wrong = [], [], 0, 0, 0
    for s in slides:
        r = s["repaired"][share]
        if r[probe]["residual"] <= threshold and r[probe]["top_holds"]:
            stood += 1
            agrees.append(r["agrees"])
            kls.append(r["kl"])
            spent += s["lead"] + r["rows"]
            wrong += not r["agrees"]
        else:  # re-prefilled: the rows recomputed were spent for nothing
            agrees.append(True)
            kls.append(0.0)
            spent += s["tokens"] + r["rows"]
    refill = sum(s["tokens"] for s in slides)
    return {
        "stood": stood,
        "flipped": wrong,
        "agreement": statistics.fmean(agrees),
        "kl_mean": statistics.fmean(kls),
        "kl_max": max(kls),
        "tokens": spent,
        "refill_tokens": refill,
    }


def table(report: dict[str, Any]) -> Table:
    slides = report["slides"]
    title = f"Repair the head rows, judge the rest by the answer: {report['seeds']} slides"
    out = Table(title=title)
    for column in (
        "head share, probe",
        "threshold",
        "stand",
        "flipped",
        "first token",
        "KL mean",
        "refill / it",
    ):
        out.add_column(column, justify="left" if column.startswith("head") else "right")
    kept = [s["kept"] for s in slides]
    refill = sum(s["tokens"] for s in slides)
    kept_tokens = sum(s["lead"] for s in slides)
    out.add_row(
        "kept, no repair",
        "—",
        f"{len(slides)}",
        f"{sum(not k['agrees'] for k in kept)}",
        f"{100 * statistics.fmean(k['agrees'] for k in kept):.1f} %",
        f"{statistics.fmean(k['kl'] for k in kept):.2e}",
        f"{refill / kept_tokens:.2f}×",
    )
    for key, rows in report["verdicts"].items():
        for threshold, v in rows.items():
            out.add_row(
                key.replace(":", ", "),
                threshold,
                f"{v['stood']}",
                f"{v['flipped']}",
                f"{100 * v['agreement']:.1f} %",
                f"{v['kl_mean']:.2e}",
                f"{v['refill_tokens'] / v['tokens']:.2f}×",
            )
    return out


if __name__ == "__main__":
    main()
