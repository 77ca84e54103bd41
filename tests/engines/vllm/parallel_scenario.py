"""One vLLM engine of a given tensor-parallel degree over a shared store, in a fresh interpreter.

Run by `test_parallel.py`: ``python -m tests.engines.vllm.parallel_scenario --model DIR --tp N
--store URL|none --out FILE``. A growing conversation, vLLM's prefix cache reset before each
request, so every token past the first request's is either loaded from the store or computed;
greedy answers and vLLM's own counters of where each prompt token came from are written out.
Under TP=2 vLLM runs two worker processes (its multiprocessing executor): each holds half the KV
heads and files its piece of each chunk (`kamera_agent.engines.shards`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tests.engines.vllm.scenario import EXACT, NOTES, _prompt, _sources, connector


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--store", required=True, help="a store_url, or 'none' for vLLM alone")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    transfer = None
    if args.store != "none":
        transfer = connector(EXACT | {"store_url": args.store})
    llm = LLM(
        model=args.model,
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=2048,
        block_size=32,
        max_num_seqs=4,
        enforce_eager=True,
        kv_transfer_config=transfer,
        seed=0,
        tensor_parallel_size=args.tp,
        distributed_executor_backend="mp" if args.tp > 1 else None,
        disable_log_stats=False,
    )
    rows = []
    for count in range(2, 7):  # a growing conversation: every request's notes begin the next's
        llm.reset_prefix_cache()
        before = _sources(llm)
        prompt = TokensPrompt(prompt_token_ids=_prompt(tokenizer, NOTES[:count], "which came last?"))
        (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        after = _sources(llm)
        rows.append(
            {
                "tokens": list(out.outputs[0].token_ids),
                "external": after["external_kv_transfer"] - before["external_kv_transfer"],
                "computed": after["local_compute"] - before["local_compute"],
            }
        )
    Path(args.out).write_text(json.dumps(rows))


if __name__ == "__main__":  # vLLM's worker processes re-import this module: run only as a script
    main()
