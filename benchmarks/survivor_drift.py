"""How far does what left reach? Each kept survivor's drift after a slide or an eviction, by
its distance from the slot that changed.

Why: over ε, a drift budget re-prefills from the first chunk over it, and everything after it
(`OpRunner._keep_budget`). Re-forming only that chunk and keeping the ones after it would pay
only where what left conditions a few chunks after the change, not all of them. This measures
how far it reaches on the shipped demo model. Each op starts from a window holding every chunk
exactly (what a budget leaves behind it), pushes a new frame, then slides or evicts, keeping its
survivors as they are (``drift_budget=None``: no fix). Then every survivor at or after the
changed slot is measured: its true relative KV error against the same window re-prefilled (a
`WindowConfig.exact` window over the same chunks: the model's own forward), by its distance from
that slot, with the share within ε.

    .venv/bin/python benchmarks/survivor_drift.py                  # 16 chunks, 6 slides, 6 evictions
    .venv/bin/python benchmarks/survivor_drift.py --chunks 8 --ops 2 --json drift.json
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from typing import Any

from rich.progress import Progress
from rich.table import Table

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.common import show_and_save
from kamera_agent.config import WindowConfig
from kamera_agent.demo.model import load_demo_model
from kamera_agent.demo.task import make_items, render_legend, render_page
from kamera_agent.fidelity import relative_error
from kamera_agent.settings import configure_threads
from kamera_agent.window import KameraWindow


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--ops", type=int, default=6, help="slides, and as many evictions")
    parser.add_argument("--epsilon", type=float, default=0.03, help="the budget the share is taken at")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    configure_threads(None)
    model, tokenizer, image_processor = load_demo_model()
    backend = TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)
    frames = []
    for item in make_items(args.chunks + 2 * args.ops + 4, seed=5):
        frames += [backend.encoder.image(render_legend(item.legend[0]))]
        frames += [backend.encoder.image(render_page(page), kind="frame") for page in item.pages]
    lineup, fresh = frames[: args.chunks], iter(frames[args.chunks :])
    errors: dict[str, dict[int, list[float]]] = {"slide": defaultdict(list), "evict": defaultdict(list)}
    with Progress() as progress:
        task = progress.add_task("survivors against a re-prefill", total=2 * args.ops)
        for _ in range(args.ops):
            for op in ("slide", "evict"):
                kept = KameraWindow(backend, config=WindowConfig(drift_budget=None))
                kept.extend(lineup)  # every chunk exact: what the op starts from
                kept.push(next(fresh))
                changed = 0 if op == "slide" else len(kept) // 2
                if op == "slide":
                    kept.slide(1)
                else:
                    kept.evict(kept.refs[changed])
                lineup = [kept.chunk(ref) for ref in kept.refs]
                truth = KameraWindow(backend, config=WindowConfig.exact())
                exact = truth.extend(lineup)
                for i in range(changed, len(kept)):
                    error = relative_error(kept.chunk_kv(kept.refs[i]), truth.chunk_kv(exact[i]))
                    errors[op][i - changed].append(error)
                kept.close()
                truth.close()
                progress.advance(task)
    table = Table(
        title=f"kept survivors against a re-prefill: demo model, {args.chunks} chunks, ε {args.epsilon:g}"
    )
    for column in ("op", "distance from the change", "survivors", "median error", "min", "within ε"):
        table.add_column(column, justify="right")
    rows: list[dict[str, Any]] = []
    for op, by_distance in errors.items():
        for distance in sorted(by_distance):
            values = by_distance[distance]
            within = sum(v <= args.epsilon for v in values) / len(values)
            rows.append(
                {
                    "op": op,
                    "distance": distance,
                    "survivors": len(values),
                    "median": statistics.median(values),
                    "min": min(values),
                    "within": within,
                }
            )
            table.add_row(
                op,
                str(distance),
                str(len(values)),
                f"{statistics.median(values):.3f}",
                f"{min(values):.3f}",
                f"{within:.0%}",
            )
    report = {"chunks": args.chunks, "ops": args.ops, "epsilon": args.epsilon, "rows": rows}
    return show_and_save(table, report, args.json)


if __name__ == "__main__":
    main()
