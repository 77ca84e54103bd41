"""What kamera's vLLM connector costs vLLM's engine step, beside vLLM alone (vLLM's CPU build).

A pure-prefix workload: a conversation of ``--turns`` requests whose prompts grow to
``--prompt-tokens`` (each request the previous one's messages and ``--message-tokens``-token new
ones), so vLLM's own prefix cache serves every earlier token and the connector has nothing to
load: what it costs is its lookups on the scheduler side and its captures of every new message.
The model is a random Qwen2 saved here in the shape of Qwen2.5-1.5B (hidden 1536, 12 query and 2
KV heads of 128, MLP 8960) with ``--layers`` of its 28 layers and the byte-level tokenizer (a
256-entry vocabulary: the embedding and head are tiny, the per-token work is the layers').

Each run is one fresh interpreter (vLLM keeps process-wide state) running one setting, vLLM's
scheduler and worker in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the step is one
thread, asynchronous scheduling off: a step is the scheduling, the forward and the hooks, in
turn); settings alternate run by run (``--runs`` of each, the order flipped every run) and
medians are taken over runs. Per run: the wall time of every ``EngineCore.step`` (per request:
their sum, and the median step), the time spent inside each connector hook on that thread (both
sides), the store lookups the scheduler side made and the captures filed.

    .venv-vllm/bin/python benchmarks/vllm_step_time.py --json step_time.json
    .venv-vllm/bin/python benchmarks/vllm_step_time.py --layers 2 --prompt-tokens 1024 --runs 1  # toy

``null-connector`` is vLLM with a connector that does nothing (`NullConnector`, below): vLLM's
steps differ with any connector configured (on this CPU build its decode steps were several
times faster with one), so kamera's cost is read against it; ``vllm`` is vLLM alone.
``--before DIR`` adds another setting, ``kamera-before``: the connector imported from another
source tree (e.g. ``git archive`` of an earlier commit), alternating with the other two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("vllm", "kamera", "null-connector", "kamera-before")
EXACT = {"survivors": "removal", "rank": "full", "orbit": False, "recall_context": "current"}
HOOKS = {
    "scheduler": (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
        "get_kv_connector_stats",
    ),
    "worker": (
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
        "get_kv_connector_stats",
    ),
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="of Qwen2.5-1.5B's 28")
    parser.add_argument("--prompt-tokens", type=int, default=8192, help="the last request's prompt")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--message-tokens", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3, help="of each setting, alternating")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--before", help="also run the connector imported from this source tree")
    parser.add_argument("--skip", nargs="*", default=[], choices=SETTINGS, help="settings not to run")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        row = _engine_run(args)
        Path(args.out).write_text(json.dumps(row))
        return row
    settings = tuple(s for s in SETTINGS[:3] + (SETTINGS[3:] if args.before else ()) if s not in args.skip)
    with tempfile.TemporaryDirectory(prefix="kamera-step-time-") as tmp:
        model = _save_model(Path(tmp) / "model", args.layers)
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
        for run in range(args.runs):
            for name in settings if run % 2 == 0 else settings[::-1]:
                rows[name].append(_child(args, name, model, Path(tmp) / f"{name}-{run}.json"))
                print(f"run {run + 1} {name}: {_line(rows[name][-1])}", file=sys.stderr)
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("one", "model", "out")}}
    report |= {name: _medians(runs) for name, runs in rows.items()} | {"runs": rows}
    answers = {name: [r["answers"] for r in runs] for name, runs in rows.items()}
    first = next(iter(answers.values()))[0]
    report["answers_equal"] = all(a == first for runs in answers.values() for a in runs)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


def _line(row: dict[str, Any]) -> str:
    return (
        f"step total {row['step_ms_per_request']:.0f} ms/request, "
        f"median step {row['median_step_ms']:.1f} ms, "
        f"connector {row['connector_ms_per_request']:.2f} ms/request, "
        f"lookups {row['lookups_per_request']:.1f}"
    )


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in keys}
    hooks = {h for r in runs for h in r["hook_ms_per_request"]}
    out["hook_ms_per_request"] = {
        h: statistics.median(r["hook_ms_per_request"].get(h, 0.0) for r in runs) for h in sorted(hooks)
    }
    return out


def _child(args: argparse.Namespace, name: str, model: Path, out: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", name, "--model", str(model), "--out", str(out)]
    for flag in ("layers", "prompt_tokens", "turns", "message_tokens", "dtype"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env |= {"DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env["OMP_NUM_THREADS"] = str(os.cpu_count() or 2)  # vLLM's CPU worker would drop to one
    source = args.before if name == "kamera-before" else None
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, str(ROOT)) if p)
    with tempfile.TemporaryDirectory(prefix="kamera-step-time-") as stores:
        env["KAMERA_STORE_DIR"] = stores  # each run's own default store: none reuses another's
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the {name} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}")
    row: dict[str, Any] = json.loads(out.read_text())
    return row


def _save_model(path: Path, layers: int) -> Path:
    """A random Qwen2 of Qwen2.5-1.5B's layer shape (the benchmarks' builder) and the byte tokenizer."""
    import torch

    from kamera_agent.models.random_qwen2 import QWEN2_1_5B_SLICE, random_qwen2
    from kamera_agent.models.tiny_tokenizer import build_byte_tokenizer

    tokenizer = build_byte_tokenizer(model_max_length=32768)
    shape = replace(QWEN2_1_5B_SLICE, layers=layers, vocab=len(tokenizer))
    model = random_qwen2(shape, max_positions=32768, dtype=torch.bfloat16)
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.config.bos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _prompts(tokenizer: Any, args: argparse.Namespace) -> list[list[int]]:
    """Growing chat prompts: each request the previous one's messages and new ones."""
    import random

    rng = random.Random(0)
    words = ["field", "river", "north", "stone", "lamp", "seven", "quiet", "ledger", "amber", "orbit"]
    per_turn = max(args.prompt_tokens // args.turns, args.message_tokens)
    messages = [{"role": "system", "content": "You read the notes and answer in a word."}]
    prompts = []
    for turn in range(args.turns):
        budget = per_turn * (turn + 1)
        while len(_chat(tokenizer, messages)) < budget - args.message_tokens // 2:
            text = " ".join(rng.choice(words) for _ in range(args.message_tokens // 6))
            messages.append({"role": "user", "content": text[: args.message_tokens - 8]})
        prompts.append(_chat(tokenizer, [*messages, {"role": "user", "content": "which came last?"}]))
    return prompts


def _chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class _Clock:
    """Time spent in wrapped calls on the engine's step thread, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.thread = threading.get_ident()

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            if threading.get_ident() != self.thread:
                return original(*a, **k)
            began = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                self.seconds[label] += time.perf_counter() - began

        setattr(owner, name, timed)


def _engine_run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    transfer = _transfer(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = _prompts(tokenizer, args)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=True,
        max_model_len=len(prompts[-1]) + 64,
        block_size=32,
        max_num_seqs=2,
        max_num_batched_tokens=max(2048, len(prompts[-1]) - len(prompts[-2]) + 64),
        enforce_eager=True,
        async_scheduling=False,  # each step schedules, runs the forward and its hooks, in turn
        kv_transfer_config=transfer,
        seed=0,
    )
    core = llm.llm_engine.engine_core.engine_core
    clock, steps = _Clock(), []
    original_step = core.step_fn  # what the in-process client calls once per step

    def step(*a: Any, **k: Any) -> Any:
        began = time.perf_counter()
        try:
            return original_step(*a, **k)
        finally:
            steps.append(time.perf_counter() - began)

    core.step_fn = step
    worker, lookups = _watch(core, clock) if transfer is not None else (None, [0])
    params = SamplingParams(temperature=0.0, max_tokens=4)
    answers, wall = [], []
    for prompt in prompts:
        began = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        wall.append(time.perf_counter() - began)
        answers.append(list(out.outputs[0].token_ids))
    flushed = getattr(worker, "flush", None)
    if flushed is not None:
        flushed()
    n = len(prompts)
    hooks = {h: 1000 * s / n for h, s in clock.seconds.items()}
    captured = int(getattr(getattr(worker, "stats", None), "chunks_captured", 0))
    return {
        "prompt_tokens": [len(p) for p in prompts],
        "answers": answers,
        "requests": n,
        "steps": len(steps),
        "step_ms_per_request": 1000 * sum(steps) / n,
        "median_step_ms": 1000 * statistics.median(steps),
        "step_ms": [round(1000 * t, 3) for t in steps],
        "request_ms": 1000 * sum(wall) / n,
        "connector_ms_per_request": sum(hooks.values()),
        "hook_ms_per_request": hooks,
        "lookups_per_request": lookups[0] / n,
        "captured_chunks": captured,
    }


def _transfer(args: argparse.Namespace) -> Any:
    """vLLM's transfer config of the setting (``None``: vLLM alone)."""
    from vllm.config import KVTransferConfig

    if args.one == "vllm":
        return None
    null = args.one == "null-connector"
    module = "benchmarks.vllm_step_time" if null else "kamera_agent.engines.vllm.connector"
    return KVTransferConfig(
        kv_connector="NullConnector" if null else "KameraConnector",
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"config": EXACT},
    )


def _watch(core: Any, clock: _Clock) -> tuple[Any, list[int]]:
    """Time the connector's hooks on the step's thread and count the store lookups made there;
    the worker half (what flushes and counts captures) and the lookups counted."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler, worker = core.scheduler.connector, get_kv_transfer_group()
    for side, connector in (("scheduler", scheduler), ("worker", worker)):
        for hook in HOOKS[side]:
            clock.wrap(connector, hook, f"{side}.{hook}")
    planner = _half(scheduler, "scheduler")
    if not hasattr(planner, "store"):  # the null connector: a store that is never asked
        planner.store = SimpleNamespace(contains=lambda key: False)
    store, contains, lookups = planner.store, planner.store.contains, [0]

    def counted(key: Any) -> bool:
        if threading.get_ident() == clock.thread:
            lookups[0] += 1
        return bool(contains(key))

    store.contains = counted
    return _half(worker, "worker"), lookups


def _half(connector: Any, role: str) -> Any:
    """The half of kamera's connector that holds the store and the counters (``connector.sides``);
    a connector without halves (an older source tree's, the null one) is its own."""
    sides = getattr(connector, "sides", None)
    return connector if sides is None else getattr(sides, role)


def _null_connector() -> type:
    """A connector that offers, loads and captures nothing: vLLM's path with a connector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class Null(KVConnectorBase_V1):  # type: ignore[misc]
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            return None

        def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
            return KVConnectorMetadata()

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            return None

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            return None

        def wait_for_save(self) -> None:
            return None

    return Null


def __getattr__(name: str) -> Any:
    """``NullConnector`` is built on first use (this module imports vLLM only where it runs)."""
    if name == "NullConnector":
        return _null_connector()
    raise AttributeError(name)


if __name__ == "__main__":
    main()
