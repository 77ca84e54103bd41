"""One vLLM engine (the CPU build, in this process) whose store loses or spoils what it offered.

Run by tests/engines/vllm/test_lost.py in a fresh interpreter, in .venv-vllm:

    python -m tests.engines.vllm.lost_scenario --model DIR --out F.json

For each way an entry can fail a load (`kamera_agent.testing.ShakyTier`): **lost** (present when
the scheduler side asks, gone when the worker reads it: evicted between offer and load) and
**unreadable** (present whenever asked, every read failing):

1. a conversation is computed and captured into a fresh store (exact settings);
2. the connector's store is replaced by one claiming those entries while losing or spoiling
   them, and vLLM's prefix cache is reset;
3. two requests holding those chunks arrive together: both are offered them (in one step,
   before any load ran), every load fails, vLLM's ``recompute`` policy computes them; what the
   store was asked to read, the offers, the faults (the connector's and ``vllm:kamera_faults``),
   and where vLLM says the prompt tokens came from;
4. their captures file the entries anew; after another reset one of them, asked again, is
   served them.

The same three prompts computed by vLLM with nothing offered (an empty store) are the answers
every step must give.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tests.engines.vllm.scenario import (
    NOTES,
    _connectors,
    _drained,
    _llm,
    _prompt,
    _sources,
    flush,
    in_process,
)

QUESTIONS = ("what did the fox do?", "which came first?", "what did the owl do?")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    in_process()
    from transformers import AutoTokenizer

    import kamera_agent

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    llm = _llm(args.model, "exact", corrupt=False)
    prompts = [_prompt(tokenizer, NOTES[:4], question) for question in QUESTIONS]
    report: dict[str, Any] = {
        "kamera": str(Path(kamera_agent.__file__).parent),
        "prompt_tokens": len(prompts[0]),
    }
    _use(llm, _store(llm))  # nothing stored: vLLM computes every token, the answers to match
    report["alone"] = [_answers(llm, [p]) for p in prompts]
    for loss in ("lost", "unreadable"):
        report[loss] = _run(llm, prompts, loss)
    Path(args.out).write_text(json.dumps(report))


def _run(llm: Any, prompts: list[list[int]], loss: str) -> dict[str, Any]:
    from kamera_agent.testing import ShakyTier

    scheduler, worker = _connectors(llm)
    store = _use(llm, _store(llm))
    _reset(llm)
    _answers(llm, [prompts[0]])  # computed and captured
    captured = store.keys()
    shaky = ShakyTier(**{loss: captured})
    _use(llm, _store(llm, shaky))
    _reset(llm)
    offered, faults, counted = scheduler.stats.offered, _kamera_faults(llm), dict(worker.faults.as_dict())
    together = _counted(llm, lambda: _answers(llm, prompts[1:]))  # both offered in one step
    after_failure = {
        "offers": scheduler.stats.offered - offered,
        "reads": dict(sorted((str(k), n) for k, n in shaky.reads.items())),
        "captured": len(captured),
        "faults": {
            k: n - counted.get(k, 0) for k, n in worker.faults.as_dict().items() if n != counted.get(k)
        },
        "faults_metric": _kamera_faults(llm) - faults,
        "blocked": len(scheduler.synthesis.failed),
        **together,
    }
    _reset(llm)
    counted = dict(worker.faults.as_dict())
    again = _counted(llm, lambda: _answers(llm, [prompts[1]]))  # filed anew by their captures
    again["faults"] = {
        k: n - counted.get(k, 0) for k, n in worker.faults.as_dict().items() if n != counted.get(k)
    }
    return {"failed": after_failure, "again": again}


def _reset(llm: Any) -> None:
    """vLLM's prefix cache emptied (once the requests held for their captures are freed)."""
    _drained(llm)
    assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"


def _store(llm: Any, *tiers: Any) -> Any:
    from kamera_agent.store import ChunkStore

    scheduler, _ = _connectors(llm)
    return ChunkStore(fingerprint=scheduler.store.fingerprint, memory_limit=1 << 28, tiers=tiers)


def _use(llm: Any, store: Any) -> Any:
    """Both connector sides on ``store`` from now on (what the scheduler side remembers of the
    store before, filed entries and failed loads, is forgotten)."""
    from kamera_agent.engines.offers import FailedEntries
    from kamera_agent.engines.shards import ShardedStore, Splits

    scheduler, worker = _connectors(llm)
    scheduler.splits, scheduler.synthesis.failed = Splits(), FailedEntries()
    scheduler.synthesis.store = ShardedStore(store, scheduler.grid, splits=scheduler.splits)
    worker.synthesis.store = ShardedStore(store, worker.grid, 0, 0)
    return store


def _answers(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=4)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    flush(llm)  # the captures filed before the next step of the scenario
    return [list(out.outputs[0].token_ids) for out in outs]


def _counted(llm: Any, run: Any) -> dict[str, Any]:
    """``run()``'s answers, and where vLLM says their prompt tokens came from."""
    before = _sources(llm)
    answers = run()
    after = _sources(llm)
    return {"answers": answers, **{source: after[source] - before[source] for source in after}}


def _kamera_faults(llm: Any) -> float:
    """``vllm:kamera_faults`` summed over its hooks and kinds, as vLLM's metrics hold it."""
    return sum(float(m.value) for m in llm.get_metrics() if m.name == "vllm:kamera_faults")


if __name__ == "__main__":
    main()
