"""The GPU check of issue 18: vLLM with and without kamera's connector, side by side.

For a machine with a GPU and official vLLM (≥ 0.32; none was lent here). One offline engine per
setting (``LLM(...)``, in this process, one after another): vLLM alone, kamera's connector with
the exact settings, and with the defaults (``survivors="keep"``). Each runs the same
conversation of ``--turns`` requests on ``--model`` (default ``Qwen/Qwen2.5-1.5B-Instruct``): the
system prompt, the last ``--window`` notes (~``--note-tokens`` tokens each) and a question, the
oldest note dropped each turn; greedy. Per setting and turn: wall time of the request (the
prompt's prefill dominates: 8 answer tokens), tokens computed and loaded by source (vLLM's own
counters); then whether the exact setting's answers equal vLLM's own (they must) and the
defaults' agreement.

    python benchmarks/vllm_gpu_check.py --json vllm_gpu.json
    python benchmarks/vllm_gpu_check.py --dry-run      # the prompts only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

SETTINGS: dict[str, dict[str, Any] | None] = {
    "vllm": None,
    "kamera-exact": {"survivors": "removal", "rank": "full", "orbit": False, "recall_context": "current"},
    "kamera-defaults": {},
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--window", type=int, default=6)
    parser.add_argument("--note-tokens", type=int, default=400)
    parser.add_argument("--dry-run", action="store_true", help="build the prompts, run nothing")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    notes = [_note(i, args.note_tokens) for i in range(args.turns + args.window)]
    conversation = [
        [{"role": "system", "content": "You read field notes and answer briefly."}]
        + [{"role": "user", "content": note} for note in notes[turn : turn + args.window]]
        + [{"role": "user", "content": f"Which animal is in note {turn + args.window - 1}?"}]
        for turn in range(args.turns)
    ]
    # the connector's scheduler and worker halves share a store in one process (else: a store_url)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.dry_run:
        print(f"{len(conversation)} requests of {len(conversation[0])} messages")
        return {"dry_run": True, "requests": len(conversation)}
    report = {name: _run(args.model, config, conversation) for name, config in SETTINGS.items()}
    base = report["vllm"]["answers"]
    for name, run in report.items():
        same = sum(a == b for a, b in zip(run["answers"], base, strict=True))
        run["answers_equal_to_vllm"] = f"{same}/{len(base)}"
        later = run["seconds"][1:]
        mean_ms = 1000 * sum(later) / len(later)
        print(
            f"{name:16} mean request {mean_ms:8.1f} ms after turn 1, computed {sum(run['computed'])} / "
            f"loaded {sum(run['external'])} prompt tokens, answers = vLLM's {same}/{len(base)}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


def _run(model: str, config: dict[str, Any] | None, conversation: list[Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = None
    if config is not None:
        transfer = KVTransferConfig(
            kv_connector="KameraConnector",
            kv_connector_module_path="kamera_agent.engines.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"config": config},
        )
    llm = LLM(model=model, enable_prefix_caching=True, kv_transfer_config=transfer, disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    run: dict[str, list[Any]] = {"seconds": [], "computed": [], "external": [], "answers": []}
    for messages in conversation:
        before = _sources(llm)
        start = time.perf_counter()
        (out,) = llm.chat([messages], params, use_tqdm=False)
        run["seconds"].append(time.perf_counter() - start)
        after = _sources(llm)
        run["computed"].append(after["local_compute"] - before["local_compute"])
        run["external"].append(after["external_kv_transfer"] - before["external_kv_transfer"])
        run["answers"].append(out.outputs[0].text)
    del llm
    gc.collect()
    return run


def _sources(llm: Any) -> dict[str, float]:
    out = {"local_compute": 0.0, "external_kv_transfer": 0.0}
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_by_source" and metric.labels.get("source") in out:
            out[metric.labels["source"]] += float(metric.value)
    return out


def _note(index: int, tokens: int) -> str:
    animals = ["fox", "owl", "elk", "yak", "emu", "cat", "dog", "bat", "hen", "ram", "ant", "bee"]
    animal = animals[index % len(animals)]
    sentence = f"In note {index} the {animal} crossed the river at dawn, paused, and went on. "
    return sentence * max(1, tokens // 20)


if __name__ == "__main__":
    main()
