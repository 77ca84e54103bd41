"""Where kamera's wall time goes on one agent: cProfile over its window's steps alone.

    python -m kamera_agent.bench.agents.profile --agent web            # realistic shape, defaults
    python -m kamera_agent.bench.agents.profile --agent video --quick --top 40 --out video.prof
    python -m kamera_agent.bench.agents.profile --agent web --model demo   # the window's own overhead

Why a profiler of its own: the suite's tables say when kamera loses; this says on what. Only
the default kamera side runs (the same script, model and sizes as ``kamera bench --suite
agents``), and only its steps are profiled: script building, the checks and the final
re-prefill stay outside. On the demo model (``--model demo``: a forward takes about a
millisecond) what shows is the window's own bookkeeping. The sorted stats go to stdout;
``--out`` keeps them for snakeviz or ``pstats``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

from rich.console import Console

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.agents.contents import Contents, DemoContents, RandomContents
from kamera_agent.bench.agents.records import AgentRun
from kamera_agent.bench.agents.run import new_run, realistic_backend, run_agent
from kamera_agent.bench.agents.scripts import AGENTS
from kamera_agent.bench.common import HELD_OUT_SEED
from kamera_agent.bench.progress import make_progress
from kamera_agent.settings import configure_threads

__all__ = ["main", "profile_agent"]


def profile_agent(
    agent: str, *, model: str = "realistic", quick: bool = False, seed: int = HELD_OUT_SEED + 3
) -> tuple[AgentRun, cProfile.Profile]:
    """Run ``agent`` on kamera's default side alone, profiled; its record and profile.

    Args:
        model: ``"realistic"`` (the suite's random-init shape) or ``"demo"`` (kamera-tiny-vl).
    """
    suite = new_run(quick, [agent], "shipped")
    contents: Contents
    if model == "demo":
        from kamera_agent.demo.model import load_demo_model

        demo, tokenizer, image_processor = load_demo_model()
        backend = TransformersBackend(demo, tokenizer=tokenizer, image_processor=image_processor)
        contents = DemoContents(backend.encoder, seed)
    else:
        assert suite.shape is not None, "the vision path's run has the realistic shape"
        backend = realistic_backend(suite.shape, seed)
        contents = RandomContents(backend.encoder, suite.tokens, suite.shape.vocab, seed)
    script = AGENTS[agent](contents, suite.counts)
    record = AgentRun.of(script, model, sides=("kamera",))
    profiler = cProfile.Profile()
    with make_progress(Console(stderr=True)) as progress:
        reference = "re-prefill" if model == "demo" else "prefix"
        run_agent(script, backend, record, progress, reference=reference, profiler=profiler)
    return record, profiler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kamera_agent.bench.agents.profile", description=__doc__)
    parser.add_argument("--agent", choices=list(AGENTS), default="web")
    parser.add_argument("--model", choices=["realistic", "demo"], default="realistic")
    parser.add_argument("--quick", action="store_true", help="toy shape and sizes (a smoke run)")
    parser.add_argument("--top", type=int, default=30, help="rows per listing")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 1)")
    parser.add_argument("--out", type=Path, default=None, help="write the raw stats here")
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    began = time.perf_counter()
    record, profiler = profile_agent(args.agent, model=args.model, quick=args.quick)
    print(
        f"{args.agent} on {args.model}: {len(record.records)} steps, "
        f"kamera {record.total('kamera', 'ms') / 1e3:.1f} s wall, "
        f"{record.total('kamera', 'tokens'):.0f} tokens, {record.total('kamera', 'forwards'):.0f} forwards "
        f"(run {time.perf_counter() - began:.0f} s); by op (ms): "
        + ", ".join(f"{op} {ms:.0f}" for op, ms in record.op_ms("kamera").items())
    )
    for order in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(order).print_stats(args.top)
        print(f"\n== sorted by {order} ==\n{text.getvalue()}")
    if args.out is not None:
        profiler.dump_stats(str(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
