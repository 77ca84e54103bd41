"""One vLLM engine (the CPU build, in this process) running kamera's connector over conversations.

Run by tests/engines/vllm/test_connector.py in a fresh interpreter per setting (vLLM keeps
process-wide state), in .venv-vllm:

    python -m tests.engines.vllm.scenario --model DIR --settings exact|defaults|unbounded|none --out F.json

``defaults`` is the connector at the default drift budget, the model calibrated by the scenario
(a random model has no calibration: ε `EPSILON`); ``unbounded`` keeps with no budget.

Two conversations, greedy, the full next-token distribution of each answer's first token kept:

- **sliding**: 9 requests, each the system prompt, the last 4 notes and a question; every
  request drops the oldest note and adds one (chunks evicted at the front and moved);
- **shared** (exact settings): a kamera window and the connector on one store. A conversation a
  window held is loaded by vLLM (its notes' KV made by the window), and one vLLM computed is
  pushed into a window without a forward (its notes' KV captured from vLLM's blocks), each
  compared with the transformers model's own KV;
- **reordered** (defaults, unbounded, none): 3 requests holding notes in an order no request
  held before (a RAG retriever's ranking); under ``defaults`` a window sharing the store audits
  first (`_audit_kept`: each kept candidate's KV against the transformers model's own there,
  filed as a `DriftAudit`), so the budget serves the kept states those audits put within ε;
- **growing**: 5 requests appending a note each, vLLM's own prefix cache reset before every
  request (as if evicted, or served by another worker): what is past the system prompt must
  come from the store. After each request the KV the connector wrote into vLLM's blocks is read
  back and compared with the transformers model's own KV for those tokens at those positions.

``--corrupt`` keeps the store on disk (memory holds one entry) and damages every file before the
growing conversation's requests: nothing damaged may be loaded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

SYSTEM = "You read field notes and answer in a word."
NOTES = [
    f"note {i}: the {animal} crossed the {place} at {hour} o'clock and {act}."
    for i, (animal, place, hour, act) in enumerate(
        [
            ("fox", "river", 5, "hid"),
            ("owl", "barn", 9, "slept"),
            ("elk", "ridge", 6, "ate"),
            ("yak", "pass", 4, "rested"),
            ("emu", "field", 2, "ran"),
            ("cat", "roof", 8, "watched"),
            ("dog", "yard", 7, "barked"),
            ("bat", "cave", 1, "flew"),
            ("hen", "coop", 3, "nested"),
            ("ram", "hill", 10, "climbed"),
            ("ant", "log", 11, "dug"),
            ("bee", "hive", 12, "buzzed"),
        ]
    )
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--settings", choices=["none", "exact", "defaults", "unbounded"], required=True)
    parser.add_argument("--corrupt", action="store_true")
    parser.add_argument(
        "--inject", default="", help="comma-separated connector hooks to raise faults of every kind in"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    in_process()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.settings == "defaults":
        _calibrate(args.model)
    llm = _llm(args.model, args.settings, args.corrupt)
    free_at_start = _free_blocks(llm)
    report: dict[str, Any] = {"settings": args.settings}
    parked = _count_async_loads(llm) if args.settings != "none" else [0]
    if args.inject:
        report["injected"] = _inject(llm, args.inject.split(","))
    # an agent's sliding conversation under its own salt (approximations are served only so)
    keeps = args.settings in ("defaults", "unbounded")
    salt = "agent-1" if keeps else None
    sliding = [_prompt(tokenizer, NOTES[i : i + 4], f"what did the {i}th do?") for i in range(9)]
    report["sliding"] = [_ask(llm, prompt, salt) for prompt in sliding]
    if keeps:  # the same conversation unsalted: served exactly, as vLLM alone
        report["unsalted"] = [_ask(llm, prompt) for prompt in sliding]
    if args.settings != "exact":
        reordered = [_prompt(tokenizer, NOTES[i : i + 5][::-1], "which came first?") for i in (1, 3, 5)]
        audited = args.settings == "defaults"
        report["audits"] = [_audit_kept(llm, args.model, p, salt) for p in reordered] if audited else []
        report["reordered"] = [_ask(llm, prompt, salt) for prompt in reordered]
    growing = []
    for i in range(1, 6):
        llm.reset_prefix_cache()
        if args.corrupt:
            _damage_store()
        prompt = _prompt(tokenizer, NOTES[6 : 6 + i], "which came last?")
        _forget_loads(llm)  # the KV check reads this request's loads alone
        growing.append(_ask(llm, prompt) | {"kv_check": _kv_check(llm, args.model, prompt)})
    report["growing"] = growing
    if args.settings == "exact":
        report["shared"] = _shared(llm, args.model, tokenizer)
    report["connector"] = _connector_stats(llm)
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    report["hybrid_manager_on"] = not scheduler_config.disable_hybrid_kv_cache_manager
    report["async_loads"] = parked[0]
    report["drained"] = _drained(llm) | {"free_at_start": free_at_start}
    if args.inject:
        scheduler, worker = _connectors(llm)
        report["faults"] = {**scheduler.faults.as_dict(), **worker.faults.as_dict()}
    Path(args.out).write_text(json.dumps(report))


def in_process() -> None:
    """vLLM's CPU build with the scheduler and the worker in this process (one store, the
    connector objects at hand), a small KV cache, no thread pinning on a shared machine."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


FAULTS = (IndexError, AttributeError, ValueError, KeyError, TimeoutError)
"""What is injected, in turn: the faults kamera's code could raise at run time (a store timeout too)."""


def _inject(llm: Any, only: list[str]) -> list[str]:
    """Make the body of each named connector hook (``all``: every one) raise each kind of fault
    in turn, on every other call (the calls between pass, so the engine also sees it work)."""
    scheduler, worker = _connectors(llm)
    hooks = [
        (scheduler, "_matched"),
        (scheduler, "_allocated"),
        (scheduler, "_plan_saves"),
        (scheduler, "_forget"),
        (worker, "_load"),
        (worker, "_capture"),
    ]
    for side, name in hooks:
        if "all" not in only and name not in only:
            continue
        original = getattr(side, name)
        calls = [0]

        def faulty(*args: Any, _original: Any = original, _calls: list[int] = calls, **kwargs: Any) -> Any:
            _calls[0] += 1
            if _calls[0] % 2 == 1 and _calls[0] // 2 < len(FAULTS):
                raise FAULTS[_calls[0] // 2](f"injected fault {_calls[0] // 2}")
            return _original(*args, **kwargs)

        setattr(side, name, faulty)
    return [name for _, name in hooks if "all" in only or name in only]


EXACT: dict[str, Any] = {"survivors": "removal", "orbit": False, "rank": "full", "recall_context": "current"}
"""`WindowConfig.exact()`'s fields, as a connector's ``config``."""


def connector(config: dict[str, Any]) -> Any:
    """vLLM's transfer config for kamera's connector with ``config`` (`WindowConfig` fields)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KameraConnector",
        kv_connector_module_path="kamera_agent.engines.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",  # an entry gone or damaged: vLLM computes its blocks
        kv_connector_extra_config={"config": config},
    )


def _llm(model: str, settings: str, corrupt: bool) -> Any:
    from vllm import LLM

    transfer = None
    if settings != "none":
        config: dict[str, Any] = {"survivors": "removal", "orbit": False}
        if settings == "exact":
            config = dict(EXACT)
        elif settings == "defaults":
            config = {}
        elif settings == "unbounded":
            config = {"drift_budget": None}
        if corrupt:
            config |= {"memory_limit": 200_000, "disk_dir": _STORE_DIR, "disk_limit": 1 << 30}
        transfer = connector(config)
    return LLM(
        model=model,
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=2048,
        block_size=32,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        enforce_eager=True,
        kv_transfer_config=transfer,
        seed=0,
        max_logprobs=600,
        disable_log_stats=False,
    )


_STORE_DIR = tempfile.mkdtemp(prefix="kamera-vllm-store-")


def _damage_store() -> None:
    for path in Path(_STORE_DIR).rglob("*.safetensors"):  # the entries (not the index)
        if path.stat().st_size > 64:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))


def _prompt(tokenizer: Any, notes: list[str], question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": "user", "content": note} for note in notes]
    messages.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _ask(llm: Any, prompt: list[int], salt: str | None = None) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    before = _sources(llm)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=512)
    request = TokensPrompt(prompt_token_ids=prompt, **({"cache_salt": salt} if salt else {}))
    began = time.perf_counter()
    (out,) = llm.generate([request], params, use_tqdm=False)
    seconds = time.perf_counter() - began
    flush(llm)  # the request's captures are filed off the step: in the store before the next one
    after = _sources(llm)
    first = out.outputs[0].logprobs[0]
    return {
        "prompt_tokens": len(prompt),
        "seconds": seconds,  # the request's wall time: prefill and 6 greedy tokens
        "tokens": list(out.outputs[0].token_ids),
        "first_logprobs": {str(k): v.logprob for k, v in first.items()},
        "computed": after["local_compute"] - before["local_compute"],
        "external": after["external_kv_transfer"] - before["external_kv_transfer"],
        "local_hit": after["local_cache_hit"] - before["local_cache_hit"],
        "served": (out.kv_transfer_params or {}).get("kamera"),  # the connector's report
    }


def _sources(llm: Any) -> dict[str, float]:
    """vLLM's own counters of where each prompt token came from (cumulative)."""
    out = {"local_compute": 0.0, "external_kv_transfer": 0.0, "local_cache_hit": 0.0}
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_by_source":
            source = metric.labels.get("source", "")
            if source in out:
                out[source] += float(metric.value)
    return out


def _free_blocks(llm: Any) -> int:
    return int(
        llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    )


def _drained(llm: Any, steps: int = 50) -> dict[str, int]:
    """Step the idle engine until every finished request is gone from vLLM's scheduler (a request
    whose captures were queued off the step is freed once the worker reports its blocks copied):
    the requests left and the free blocks then (every block free again: none leaked)."""
    flush(llm)
    core = llm.llm_engine.engine_core.engine_core
    for _ in range(steps):
        if not core.scheduler.requests:
            break
        core.step_fn()
    return {"requests": len(core.scheduler.requests), "free_blocks": _free_blocks(llm)}


def _count_async_loads(llm: Any) -> list[int]:
    """Count the requests vLLM's scheduler released after an asynchronous load (its own
    ``_update_waiting_for_remote_kv``, run only for requests a connector loads off the step)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    original, count = scheduler._update_waiting_for_remote_kv, [0]

    def counted(request: Any) -> None:
        count[0] += 1
        original(request)

    scheduler._update_waiting_for_remote_kv = counted
    return count


def flush(llm: Any) -> None:
    """Wait until the worker's background writer has filed every capture (in-process engines;
    vLLM alone has no connector)."""
    try:
        _, worker = _connectors(llm)
    except (AttributeError, AssertionError):
        return
    assert worker.flush(timeout=60.0), "the connector's captures were not filed within a minute"


EPSILON = 0.5
"""The drift budget the scenario's calibration gives the model (scale 1, inherit ½): wide, so that
on this random model, whose kept chunks are 40-60 % off the model's own KV in a new order, the
first kept chunk of a request passes and the next (inheriting half of it) does not."""


def _calibrate(model_dir: str) -> None:
    """File a calibration for the model (as ``kamera calibrate`` would) where the connector finds it."""
    import torch

    from kamera_agent.fidelity import CALIBRATION_DIR_VARIABLE, Calibration, save_calibration
    from kamera_agent.fingerprint import checkpoint_fingerprint

    directory = tempfile.mkdtemp(prefix="kamera-calibration-")
    os.environ[CALIBRATION_DIR_VARIABLE] = directory
    fingerprint = checkpoint_fingerprint(model_dir, torch.float32)
    save_calibration(Calibration(fingerprint, scale=1.0, inherit=0.5, budget=EPSILON), Path(directory))


def _audit_kept(llm: Any, model_dir: str, prompt: list[int], salt: str | None) -> list[dict[str, Any]]:
    """What a window sharing the store would file before ``prompt`` is served: each chunk the
    connector could serve kept (its unbounded plan), audited against the transformers model's own
    KV of the whole prompt (every row, behind the exact chunks before it), filed as a `DriftAudit`."""
    from dataclasses import replace

    import torch

    from kamera_agent.core.identity import Context
    from kamera_agent.engines.chunking import request_chunks
    from kamera_agent.fidelity import relative_error
    from kamera_agent.operator.layout import ChunkKV, relocate
    from kamera_agent.store import DriftAudit

    scheduler, _ = _connectors(llm)
    namespace = f"|{salt}" if salt else ""
    chunks = request_chunks(prompt, [], scheduler.rules, namespace)
    plan = replace(scheduler.synthesis, budget=None).plan(namespace, chunks, 0, len(prompt) - 1)
    truth = _hf_kv(model_dir, prompt)
    left, filed = Context.root(chunks[0].key), []
    for item in plan.served[1:]:  # the first is the anchor, served as its canonical
        if not item.computed:
            kv = scheduler.synthesis.read(item.entry)
            a, b = item.chunk.start, item.chunk.end
            want = ChunkKV(
                torch.stack([k[a:b].transpose(0, 1) for k, _ in truth]),
                torch.stack([v[a:b].transpose(0, 1) for _, v in truth]),
            )
            placed = relocate(kv, scheduler.layout, torch.arange(a, b))
            error = relative_error(placed, want)
            scheduler.store.put_audit(
                DriftAudit(item.chunk.key, item.state.digest, left.digest, error, b - a)
            )
            filed.append({"start": a, "tokens": b - a, "error": error})
        left = left.extend(item.state)
    return filed


def _connectors(llm: Any) -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return scheduler.sides.scheduler, get_kv_transfer_group().sides.worker  # the facade's halves


def _connector_stats(llm: Any) -> dict[str, Any]:
    try:
        scheduler, worker = _connectors(llm)
    except (AttributeError, AssertionError):
        return {}
    return {
        "scheduler": vars(scheduler.stats),
        "worker": vars(worker.stats),
        # kept loads recorded once the worker side reported them written; offers still unreported
        "recorded": len(scheduler.synthesis._loaded),
        "unconfirmed": len(scheduler._offered),
    }


def _forget_loads(llm: Any) -> None:
    """The worker's record of its latest loads emptied (vLLM alone has none)."""
    try:
        _, worker = _connectors(llm)
    except (AttributeError, AssertionError):
        return
    worker.recent_loads.clear()


def _kv_check(llm: Any, model_dir: str, prompt: list[int]) -> dict[str, Any]:
    """The blocks the connector wrote for the last request against the model's own KV there."""
    try:
        _, worker = _connectors(llm)
    except (AttributeError, AssertionError):
        return {}
    import torch

    from kamera_agent.engines.vllm.addressing import read_tokens

    if not worker.recent_loads:
        return {"tokens": 0}
    last = worker.recent_loads[-1].req_id
    loads = [load for load in worker.recent_loads if load.req_id == last]
    truth = _hf_kv(model_dir, prompt)
    worst = 0.0
    tokens = 0
    for load in loads:
        rows = list(range(load.start, load.start + load.entry_to - load.entry_from))
        slots = torch.tensor(load.slots, dtype=torch.long)
        for layer, (cache, where) in enumerate(
            zip(worker._pool.caches, worker._pool.addressings, strict=True)
        ):
            keys, values = read_tokens(cache, where, slots)
            want_k, want_v = truth[layer][0][rows], truth[layer][1][rows]
            for got, want in ((keys, want_k), (values, want_v)):
                worst = max(worst, float((got.float() - want).norm() / want.norm().clamp_min(1e-12)))
        tokens += len(rows)
    worker.recent_loads.clear()
    return {"tokens": tokens, "worst_relative_error": worst}


_HF: dict[str, Any] = {}


def _hf_kv(model_dir: str, prompt: list[int]) -> list[tuple[Any, Any]]:
    """The transformers model's own cache for ``prompt``: per layer ``[tokens, kv_heads, head]``."""
    import torch
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF:
        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = _HF[model_dir]
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    return [
        (layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
        for layer in out.past_key_values.layers
    ]


MEMOS = [
    f"memo {i}: the {thing} was moved to shelf {i + 3} before the {day} count."
    for i, (thing, day) in enumerate(
        [
            ("lamp", "monday"),
            ("rope", "tuesday"),
            ("kettle", "friday"),
            ("ladder", "sunday"),
            ("drum", "june"),
            ("sail", "may"),
        ]
    )
]
"""Text no other conversation here holds: what the shared-store checks push is new to the store."""


def _shared(llm: Any, model_dir: str, tokenizer: Any) -> dict[str, Any]:
    """Window → vLLM, then vLLM → window, through the connector's own store."""
    from kamera_agent import KameraWindow, WindowConfig

    scheduler, _ = _connectors(llm)
    store, config = scheduler.store, WindowConfig.exact()
    # vLLM first sees the system prompt alone (its capture files the anchor, as a server's would)
    _ask(llm, _prompt(tokenizer, [], "ready?"))
    window = KameraWindow(model_dir, config=config, store=store, system_prompt=SYSTEM)
    for note in MEMOS[:3]:
        window.push_message("user", note)
    llm.reset_prefix_cache()  # nothing of the conversation in vLLM's own cache: it must load
    prompt = _prompt(tokenizer, MEMOS[:3], "which came last?")
    to_vllm = _ask(llm, prompt) | {"kv_check": _kv_check(llm, model_dir, prompt)}

    llm.reset_prefix_cache()  # the reverse: vLLM computes (and captures) another conversation
    notes = MEMOS[3:]
    prompt = _prompt(tokenizer, notes, "which came last?")
    from_vllm = _ask(llm, prompt)
    reader = KameraWindow(model_dir, config=config, store=store, system_prompt=SYSTEM)
    refs = [ref for note in notes for ref in reader.push_message("user", note)]
    pushed = reader.stats.total
    truth, worst = _hf_kv(model_dir, prompt), 0.0
    for ref, (a, b) in zip(refs, _note_rows(tokenizer, notes), strict=True):
        kv = reader.chunk_kv(ref)  # the note's KV at its place in the window: [layers, heads, n, dim]
        for layer, (want_k, want_v) in enumerate(truth):
            for got, want in ((kv.keys[layer], want_k[a:b]), (kv.values[layer], want_v[a:b])):
                got = got.transpose(0, 1).float()
                worst = max(worst, float((got - want).norm() / want.norm().clamp_min(1e-12)))
    return {
        "window_forwards": window.stats.total.forwards,
        "to_vllm": to_vllm,
        "from_vllm": from_vllm,
        "reader_forwards": pushed.forwards,
        "reader_tokens_reused": pushed.tokens_reused,
        "reader_worst_relative_error": worst,
    }


def _note_rows(tokenizer: Any, notes: list[str]) -> list[tuple[int, int]]:
    """Where each note's message sits in a prompt of the system prompt and ``notes``."""
    return [
        (len(_chat(tokenizer, notes[:i])), len(_chat(tokenizer, notes[: i + 1]))) for i in range(len(notes))
    ]


def _chat(tokenizer: Any, notes: list[str]) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}] + [{"role": "user", "content": n} for n in notes]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def kl(p: dict[str, float], q: dict[str, float]) -> float:
    """KL(p || q) over the tokens both distributions list (the full vocabulary here)."""
    shared = p.keys() & q.keys()
    return sum(math.exp(p[t]) * (p[t] - q[t]) for t in shared)


if __name__ == "__main__":
    main()
