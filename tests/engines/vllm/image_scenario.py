"""The shipped demo model (Qwen2-VL class) on vLLM's CPU build with images, in a fresh interpreter.

Run by `test_images.py`: ``python -m tests.engines.vllm.image_scenario --settings none|exact
--out FILE``, with the torchvision stand-in (``scripts/sglang_stubs``) on ``PYTHONPATH``: vLLM's
Qwen2-VL module imports transformers' image processor, which imports torchvision at module level,
and no torchvision build imports beside the CPU torch here; the slow (PIL) processor runs. A
conversation growing around one rendered page image, then the same conversation's text alone,
vLLM's prefix cache reset before each request: greedy answers, vLLM's counters of where each
prompt token came from, and the connector's own counters.
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

from tests.engines.vllm.scenario import EXACT, NOTES, _connector_stats, _sources, connector


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings", choices=["none", "exact"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    from kamera_agent.demo.model import DEMO_MODEL_DIR
    from kamera_agent.demo.task import make_item, render_page

    transfer = None
    if args.settings == "exact":
        transfer = connector(EXACT)
    llm = LLM(
        model=str(DEMO_MODEL_DIR),
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=2048,
        enforce_eager=True,
        limit_mm_per_prompt={"image": 1},
        mm_processor_kwargs={"use_fast": False},  # the PIL processor: no torchvision
        kv_transfer_config=transfer,
        seed=0,
        disable_log_stats=False,
    )
    page = _data_url(render_page(make_item(random.Random(4), "colour").pages[0]))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    report: dict[str, Any] = {"images": [], "text": []}
    for count in range(1, 4):
        for part, with_image in (("images", True), ("text", False)):
            llm.reset_prefix_cache()
            before = _sources(llm)
            messages = _messages(NOTES[:count], page if with_image else None)
            (out,) = llm.chat([messages], params, use_tqdm=False)
            after = _sources(llm)
            report[part].append(
                {
                    "tokens": list(out.outputs[0].token_ids),
                    "external": after["external_kv_transfer"] - before["external_kv_transfer"],
                    "computed": after["local_compute"] - before["local_compute"],
                }
            )
    report["connector"] = _connector_stats(llm) if transfer is not None else {}
    Path(args.out).write_text(json.dumps(report))


def _messages(notes: list[str], image: str | None) -> list[dict[str, Any]]:
    first: list[dict[str, Any]] = [{"type": "text", "text": "Read the page and the notes."}]
    if image is not None:
        first.insert(0, {"type": "image_url", "image_url": {"url": image}})
    messages = [{"role": "user", "content": first}]
    messages += [{"role": "user", "content": note} for note in notes]
    messages.append({"role": "user", "content": "Absent colour?"})
    return messages


def _data_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


if __name__ == "__main__":
    main()
