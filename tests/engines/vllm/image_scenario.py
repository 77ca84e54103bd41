"""The shipped demo model (Qwen2-VL class, M-RoPE) on vLLM's CPU build with images, one engine per process.

Run by `test_images.py`: ``python -m tests.engines.vllm.image_scenario --role ROLE --store DIR
--out FILE``, with the torchvision stand-in (``scripts/sglang_stubs``) on ``PYTHONPATH``: vLLM's
Qwen2-VL module imports transformers' image processor, which imports torchvision at module level,
and no torchvision build imports beside the CPU torch here; the slow (PIL) processor runs.

Roles (each a fresh interpreter: vLLM keeps process-wide state, and a second engine is what
another server on the same store is):

- ``alone``: vLLM without the connector answers every request of the conversation;
- ``first`` / ``second`` (exact settings, one disk store): the conversation's first requests on
  one engine, the rest on another; vLLM's prefix cache is reset before each request (as if evicted,
  or served by another worker), so what is past the system prompt must come from the store;
  ``second`` then opens a window on the store and pushes the conversation's messages, images
  included, cut as the engine cuts them;
- ``kept`` (kept states allowed: ``drift_budget`` unbounded, a salted conversation): the
  conversation, then the same with its oldest exchanges dropped, so the images that survive
  have moved.

Each request reports its greedy tokens, the first token's log-probabilities, vLLM's counters of
where prompt tokens came from, the connector's per-request report (``kv_transfer_params``), the
image tokens its loads wrote, and whether the connector's M-RoPE positions are vLLM's runner's.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
from pathlib import Path
from typing import Any

from tests.engines.vllm.scenario import (
    EXACT,
    _connector_stats,
    _connectors,
    _drained,
    _sources,
    connector,
    flush,
)

FIRST = 10
"""Requests the ``first`` engine answers; ``second`` answers the rest of `conversation`."""


def conversation() -> list[tuple[str, list[str | int]]]:
    """The messages ``(role, parts)`` of a conversation around four page images (an ``int``
    part is the image of that index), a request after each user message."""
    out: list[tuple[str, list[str | int]]] = []
    for i in range(20):
        if i % 5 == 0:
            out.append(("user", [i // 5, f"Page {i // 5}: read it."]))
        else:
            out.append(("user", [f"note {i}: the {['fox', 'owl', 'elk', 'yak'][i % 4]} ran."]))
        out.append(("assistant", [f"seen {i}."]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["alone", "first", "second", "kept"], required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import kamera_agent

    report: dict[str, Any] = {"kamera_agent": kamera_agent.__file__}
    store = {"disk_dir": args.store, "disk_limit": 1 << 30}
    if args.role == "kept":
        llm = _llm({"drift_budget": None} | store)
        report["requests"] = _kept(llm)
    else:
        llm = _llm(None if args.role == "alone" else EXACT | store)
        turns = {"alone": range(20), "first": range(FIRST), "second": range(FIRST, 20)}[args.role]
        history = conversation()
        report["requests"] = [_ask(llm, history[: 2 * i + 1]) for i in turns]
    if args.role != "alone":
        report["connector"] = _connector_stats(llm)
        scheduler, _ = _connectors(llm)
        scheduler.store.flush()
    if args.role == "second":
        report["window"] = _window(EXACT | store)
    Path(args.out).write_text(json.dumps(report))


def _llm(config: dict[str, Any] | None) -> Any:
    from vllm import LLM

    from kamera_agent.demo.model import DEMO_MODEL_DIR

    llm = LLM(
        model=str(DEMO_MODEL_DIR),
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=2048,
        enforce_eager=True,
        block_size=32,
        limit_mm_per_prompt={"image": 4},
        mm_processor_kwargs={"use_fast": False},  # the PIL processor: no torchvision
        kv_transfer_config=None if config is None else connector(config),
        seed=0,
        max_logprobs=20,
        disable_log_stats=False,
    )
    if config is not None:
        _record_positions(llm)
    return llm


def _kept(llm: Any) -> list[dict[str, Any]]:
    """The conversation's first 13 messages (two pages) under a salt, then the same with the
    oldest exchange (the first page and its reply, then also a note and its reply) dropped: the
    second page survives, moved to the left."""
    history = conversation()[:13]
    asked = [_ask(llm, history, "agent-7")]
    for dropped in (2, 4):
        asked.append(_ask(llm, history[dropped:], "agent-7") | {"dropped": dropped})
    return asked


def _ask(llm: Any, messages: list[tuple[str, list[str | int]]], salt: str | None = None) -> dict[str, Any]:
    from vllm import SamplingParams

    _drained(llm)  # the last request's blocks freed (its captures copied), so the reset empties the cache
    assert llm.reset_prefix_cache()
    _forget(llm)
    before = _sources(llm)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=20)
    chat = [_message(role, parts) for role, parts in messages]
    if salt is None:
        (out,) = llm.chat([chat], params, use_tqdm=False)
    else:  # the chat rendered by the model's template, as `chat` does, with the request's salt
        text = llm.get_tokenizer().apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        images = [page(part) for _, parts in messages for part in parts if isinstance(part, int)]
        prompt = {"prompt": text, "multi_modal_data": {"image": images}, "cache_salt": salt}
        (out,) = llm.generate([prompt], params, use_tqdm=False)
    flush(llm)  # the request's captures are filed off the step: in the store before the next one
    after = _sources(llm)
    first = out.outputs[0].logprobs[0]
    return {
        "images": sum(1 for _, parts in messages for part in parts if isinstance(part, int)),
        "prompt_tokens": len(out.prompt_token_ids),
        "tokens": list(out.outputs[0].token_ids),
        "first_logprobs": {str(k): v.logprob for k, v in first.items()},
        "computed": after["local_compute"] - before["local_compute"],
        "external": after["external_kv_transfer"] - before["external_kv_transfer"],
        "served": (out.kv_transfer_params or {}).get("kamera"),
        "image_tokens_loaded": _image_tokens_loaded(llm, out.prompt_token_ids),
        "positions_as_vllm": _positions_agree(llm),
    }


def _message(role: str, parts: list[str | int]) -> dict[str, Any]:
    content = [
        {"type": "image_url", "image_url": {"url": _data_url(part)}}
        if isinstance(part, int)
        else {"type": "text", "text": part}
        for part in parts
    ]
    return {"role": role, "content": content}


def page(index: int) -> Any:
    """The demo task's page image ``index`` (a PIL image)."""
    from kamera_agent.demo.task import make_item, render_page

    return render_page(make_item(random.Random(40 + index), "colour").pages[0])


def _data_url(index: int) -> str:
    buffer = io.BytesIO()
    page(index).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _forget(llm: Any) -> None:
    try:
        scheduler, worker = _connectors(llm)
    except (AttributeError, AssertionError):
        return
    worker.recent_loads.clear()
    scheduler.recorded_positions.clear()
    _runner(llm).recorded_positions.clear()


def _image_tokens_loaded(llm: Any, prompt: list[int]) -> int:
    """Image placeholder tokens among those the worker's loads wrote for the last request."""
    try:
        _, worker = _connectors(llm)
    except (AttributeError, AssertionError):
        return 0
    from kamera_agent.demo.model import demo_config

    pad = demo_config().image_token_id
    return sum(
        1
        for load in worker.recent_loads
        for t in range(load.start, load.start + load.entry_to - load.entry_from)
        if prompt[t] == pad
    )


def _record_positions(llm: Any) -> None:
    """Keep the positions the connector's scheduler side computes and those vLLM's model runner
    computes for the same request (its own ``_init_mrope_positions``)."""
    scheduler, _ = _connectors(llm)
    runner = _runner(llm)
    scheduler.recorded_positions, runner.recorded_positions = [], []
    assert scheduler.mrope is not None
    compute = scheduler.mrope.of
    init = runner._init_mrope_positions

    def of(tokens: Any, features: Any) -> Any:
        positions = compute(tokens, features)
        scheduler.recorded_positions.append(positions)
        return positions

    def runner_init(req_state: Any) -> None:
        init(req_state)
        runner.recorded_positions.append(req_state.mrope_positions.clone())

    scheduler.mrope.of = of
    runner._init_mrope_positions = runner_init


def _runner(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def _positions_agree(llm: Any) -> bool | None:
    try:
        scheduler, _ = _connectors(llm)
    except (AttributeError, AssertionError):
        return None
    ours, vllms = scheduler.recorded_positions, _runner(llm).recorded_positions
    if not ours:
        return None
    return len(ours) == len(vllms) and all(a.equal(b) for a, b in zip(ours, vllms, strict=True))


def _window(config: dict[str, Any]) -> dict[str, Any]:
    """A window on the engines' store pushes the conversation's messages as the engine cut them
    (a message's opening marker and its image as chunks of their own, its text with the closing
    marker): what it finds stored it reuses (no vision encode, no forward)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from kamera_agent import KameraWindow, WindowConfig
    from kamera_agent.demo.model import DEMO_MODEL_DIR

    window = KameraWindow(
        DEMO_MODEL_DIR,
        tokenizer=AutoTokenizer.from_pretrained(DEMO_MODEL_DIR),
        image_processor=AutoImageProcessor.from_pretrained(DEMO_MODEL_DIR, use_fast=False),  # as vLLM's
        config=WindowConfig(**config),
        conversation=True,
    )
    conversation_ = window.conversation
    assert conversation_ is not None
    images = []
    for role, parts in conversation()[:39]:  # the last request's messages
        if isinstance(parts[0], int):
            opened = conversation_.message(role, [page(parts[0])], markers_apart=True, closed=False)
            before = window.stats.total
            window.extend(opened)
            pushed = window.stats.total
            images.append(
                {
                    "tokens": opened[1].num_tokens,
                    "vision_encodes": pushed.vision_encodes - before.vision_encodes,
                    "forwards": pushed.forwards - before.forwards,
                    "tokens_reused": pushed.tokens_reused - before.tokens_reused,
                }
            )
            window.extend(conversation_.message(role, [str(parts[1])], opened=False))
        else:
            window.push_message(role, str(parts[0]))
    total = window.stats.total
    return {
        "images": images,
        "forwards": total.forwards,
        "vision_encodes": total.vision_encodes,
        "tokens_reused": total.tokens_reused,
        "tokens": sum(window.chunk(ref).num_tokens for ref in window.refs),
    }


if __name__ == "__main__":
    main()
