"""Images through vLLM's CPU build with the connector: the shipped Qwen2-VL-class demo model.

A request with images on an M-RoPE model is neither served nor captured by the connector (its
positions are vLLM's to compute): it must run exactly as vLLM alone. The same engine still
serves text-only requests from the store. Each setting runs in a fresh interpreter
(`image_scenario.py`) with the torchvision stand-in on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[3]


def _run(settings: str, out: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "tests.engines.vllm.image_scenario", "--settings", settings]
    command += ["--out", out]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {
        "PYTHONPATH": str(ROOT / "scripts" / "sglang_stubs"),  # torchvision's stand-in, this run only
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    report: dict[str, Any] = json.loads(Path(out).read_text())
    return report


def test_image_requests_run_as_vllm_alone_and_text_requests_are_still_served(tmp_path: Path) -> None:
    alone = _run("none", str(tmp_path / "alone.json"))
    kamera = _run("exact", str(tmp_path / "exact.json"))
    for part in ("images", "text"):
        assert [r["tokens"] for r in kamera[part]] == [r["tokens"] for r in alone[part]], part
    assert all(r["external"] == 0 for r in kamera["images"])  # M-RoPE image requests: vLLM's own
    worker = kamera["connector"]["worker"]
    assert worker["failed"] == 0 and worker["loads"] > 0, worker
    loaded = sum(r["external"] for r in kamera["text"])
    assert loaded > 0 and kamera["text"][-1]["computed"] < alone["text"][-1]["computed"]
    print(
        f"images on vLLM's CPU build (demo model): {len(alone['images'])} image requests answered as "
        f"vLLM alone, none served; text-only requests in the same engine: {loaded:.0f} tokens loaded",
        file=sys.stderr,
    )
