"""One agent of ``kamera bench --suite agents`` under other window settings, side by side with the
defaults and the prefix cache, on the realistic shape (8 layers of a 1.5B-class Qwen2, random
init, float32).

Why: the suite judges kamera at its defaults; a setting that trades fidelity for time (e.g.
``cascade="keep"`` for a reader that goes back to earlier pages) is measured here on the same
script, in the same process, the side order rotating every step, with the final window's
next-token KL to the model's own re-prefill beside wall time and tokens.

    python benchmarks/agent_settings.py --agent document --set cascade=keep
    python benchmarks/agent_settings.py --agent web --set survivors=removal
    python benchmarks/agent_settings.py --agent document --set cascade=keep --model demo --seeds 10

``--model demo`` runs the script on the shipped demo model instead, once per seed (its items),
every answer checked against the model's own re-prefill: top-1 agreement and mean KL per side.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.progress import Progress
from rich.table import Table

from kamera_agent.bench.agents.contents import RandomContents
from kamera_agent.bench.agents.records import PREFIX, AgentRun
from kamera_agent.bench.agents.run import QUICK_SHAPE, realistic_backend, run_agent, warm
from kamera_agent.bench.agents.scripts import AGENTS, QUICK_TOKENS, REALISTIC_TOKENS, AgentCounts
from kamera_agent.bench.common import show_and_save
from kamera_agent.config import WindowConfig
from kamera_agent.models.random_qwen2 import QWEN2_1_5B_SLICE
from kamera_agent.settings import configure_threads

SIDES = ("kamera", "variant", PREFIX)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", choices=sorted(AGENTS), default="document")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a WindowConfig field (VALUE read as JSON where it parses: drift_budget=null, rank=4)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--quick", action="store_true", help="toy shape and counts (a smoke run)")
    parser.add_argument("--model", choices=["realistic", "demo"], default="realistic")
    parser.add_argument("--seeds", type=int, default=1, help="demo model: item seeds to run")
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    overrides = {key: _value(text) for key, text in (item.split("=", 1) for item in args.set)}
    if args.model == "demo":
        return _on_demo(args, overrides)
    shape = QUICK_SHAPE if args.quick else QWEN2_1_5B_SLICE
    backend = realistic_backend(shape, args.seed)
    warm(backend)
    tokens = QUICK_TOKENS if args.quick else REALISTIC_TOKENS
    contents = RandomContents(backend.encoder, tokens, shape.vocab, args.seed)
    script = AGENTS[args.agent](contents, AgentCounts.quick() if args.quick else AgentCounts())
    record = AgentRun.of(script, "realistic", SIDES)
    base = {"capacity_chunks": script.capacity, "max_new_tokens": 1}
    configs = {"kamera": WindowConfig(**base), "variant": WindowConfig(**base, **overrides)}
    with Progress() as progress:
        run_agent(script, backend, record, progress, reference=PREFIX, configs=configs)
    report: dict[str, Any] = {"agent": args.agent, "variant": overrides, "sides": {}}
    table = Table(title=f"{args.agent} · realistic shape · variant {overrides}")
    for column in ("side", "wall s", "tokens", "forwards", "wall ×", "tokens ×", "final-window KL"):
        table.add_column(column, justify="right")
    for side in SIDES:
        figures = {
            "ms": record.total(side, "ms"),
            "tokens": record.total(side, "tokens"),
            "forwards": record.total(side, "forwards"),
            "final_kl": record.final_kl.get(side),
        }
        report["sides"][side] = figures
        kl = figures["final_kl"]
        table.add_row(
            side,
            f"{figures['ms'] / 1e3:.1f}",
            f"{figures['tokens']:.0f}",
            f"{figures['forwards']:.0f}",
            f"{record.ratio('ms', side):.2f}×",
            f"{record.ratio('tokens', side):.2f}×",
            "–" if kl is None else f"{kl:.1e}",
        )
    return show_and_save(table, report, args.json)


def _on_demo(args: argparse.Namespace, overrides: dict[str, str]) -> dict[str, Any]:
    """The agent on the demo model, once per seed: answers against the model's own re-prefill."""
    from kamera_agent.backends.transformers import TransformersBackend
    from kamera_agent.bench.agents.contents import DemoContents
    from kamera_agent.demo.model import load_demo_model

    model, tokenizer, image_processor = load_demo_model()
    backend = TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)
    warm(backend)
    sides = ("kamera", "variant")
    totals = {side: {"agree": 0, "asks": 0, "kl": 0.0, "tokens": 0.0} for side in sides}
    counts = AgentCounts.quick() if args.quick else AgentCounts()
    with Progress() as progress:
        for seed in range(args.seed, args.seed + args.seeds):
            script = AGENTS[args.agent](DemoContents(backend.encoder, seed), counts)
            record = AgentRun.of(script, "demo", sides)
            base = {"capacity_chunks": script.capacity, "max_new_tokens": 1}
            configs = {"kamera": WindowConfig(**base), "variant": WindowConfig(**base, **overrides)}
            run_agent(script, backend, record, progress, reference="re-prefill", configs=configs)
            for side in sides:
                totals[side]["agree"] += sum(ask.top1[side] for ask in record.asks)
                totals[side]["asks"] += len(record.asks)
                totals[side]["kl"] += sum(ask.kl[side] for ask in record.asks)
                totals[side]["tokens"] += record.total(side, "tokens")
    table = Table(title=f"{args.agent} · demo model, {args.seeds} seeds · variant {overrides}")
    for column in ("side", "top-1 vs re-prefill", "mean KL", "tokens"):
        table.add_column(column, justify="right")
    report: dict[str, Any] = {"agent": args.agent, "variant": overrides, "model": "demo", "sides": {}}
    for side in sides:
        t = totals[side]
        share, kl = t["agree"] / max(1, t["asks"]), t["kl"] / max(1, t["asks"])
        report["sides"][side] = {"top1": share, "mean_kl": kl, "asks": t["asks"], "tokens": t["tokens"]}
        table.add_row(side, f"{t['agree']}/{t['asks']} = {share:.1%}", f"{kl:.2e}", f"{t['tokens']:.0f}")
    return show_and_save(table, report, args.json)


def _value(text: str) -> Any:
    """A ``--set`` value: JSON where it parses (``null``, numbers), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


if __name__ == "__main__":
    main()
