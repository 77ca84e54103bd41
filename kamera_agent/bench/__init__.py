"""``kamera bench``: fidelity, cost and window-episode benchmarks, run side by side in one process.

- `fidelity`: every reuse arm (blind, CacheBlend- and EPIC-style recompute, kamera patches by
  rank, deep-half and orbit patches) on the same held-out demo items, against re-prefill;
- `cost`: time to first token after reuse versus after re-prefill, bytes, break-even;
- `window_suite`: a long scripted agent episode through `KameraWindow` against a real
  prefix cache (`prefix_cache`, vision-tower outputs cached by content as vLLM and SGLang do),
  every side measured against the model's own re-prefill after every op;
- `frontier`: that episode under every setting (exact, the defaults, blind, each single-knob
  change), one row each: KL after every op (mean, p90, max), first-token agreement, tokens,
  forwards, wall time against the prefix cache in the same run;
- `agents`: four agents (stream, video, web, document) as scripts of window ops, each on
  kamera (defaults and exact settings) and the prefix cache, on a realistic shape and the
  demo model, checked after every step;
- `results`, `report`, `plots`: results.json, the tables (screen and report.md), PNG plots;
- `runner`: the command (``add_bench_parser``, ``run_bench_command``) and `run_bench`.
"""

from kamera_agent.bench.common import BenchOptions
from kamera_agent.bench.runner import BenchOutcome, add_bench_parser, run_bench, run_bench_command

__all__ = ["BenchOptions", "BenchOutcome", "add_bench_parser", "run_bench", "run_bench_command"]
