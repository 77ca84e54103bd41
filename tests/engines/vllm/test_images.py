"""Images through vLLM's CPU build with the connector: the shipped Qwen2-VL-class demo model (M-RoPE).

A conversation around four page images runs on vLLM alone, then on two engines in turn sharing
one disk store (exact settings): the second engine loads the image chunks the first captured,
and every request answers as vLLM alone. A salted conversation with kept states allowed loads
its surviving image moved. A window on the store finds the engines' image KV. Each engine runs
in a fresh interpreter (`image_scenario.py`) with the torchvision stand-in on ``PYTHONPATH``.
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

LOGPROB_TOLERANCE = 1e-3
"""Largest first-token log-probability difference from vLLM alone: the loaded KV is the same
float32 KV rotated to its positions and back (relative error ~1e-6), so the logits move by
rounding only; a chunk placed at wrong positions moves them by orders of magnitude more."""


def _run(role: str, store: Path, out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "tests.engines.vllm.image_scenario", "--role", role]
    command += ["--store", str(store), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {
        "PYTHONPATH": str(ROOT / "scripts" / "sglang_stubs"),  # torchvision's stand-in, this run only
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["kamera_agent"].startswith(str(ROOT)), report["kamera_agent"]  # this checkout's code
    return report


def _largest_gap(a: dict[str, float], b: dict[str, float]) -> float:
    return max(abs(a[t] - b[t]) for t in a.keys() & b.keys())


def test_image_conversations_move_between_engines_and_a_window_through_the_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    alone = _run("alone", store, tmp_path / "alone.json")["requests"]
    first = _run("first", store, tmp_path / "first.json")
    second = _run("second", store, tmp_path / "second.json")
    served = first["requests"] + second["requests"]
    assert len(served) == len(alone) >= 20
    for i, (ours, theirs) in enumerate(zip(served, alone, strict=True)):
        assert ours["tokens"][0] == theirs["tokens"][0], i  # greedy first tokens as vLLM alone
        assert _largest_gap(ours["first_logprobs"], theirs["first_logprobs"]) < LOGPROB_TOLERANCE, i
        assert ours["positions_as_vllm"] is True, i  # the connector's M-RoPE rows are vLLM's runner's
    continued = second["requests"]
    assert all(r["served"]["loaded_tokens"] > 0 and r["image_tokens_loaded"] > 0 for r in continued)
    assert continued[0]["image_tokens_loaded"] >= 2 * 96  # the first engine's pages, loaded here
    assert all(r["external"] == r["served"]["loaded_tokens"] for r in served)  # vLLM counted them
    for side in (first, second):
        assert side["connector"]["worker"]["failed"] == 0, side["connector"]

    window = second["window"]
    assert len(window["images"]) == 4
    assert all(i["vision_encodes"] == 0 and i["tokens_reused"] >= i["tokens"] for i in window["images"])
    assert window["forwards"] == 0 and window["tokens_reused"] == window["tokens"]

    kept = _run("kept", store, tmp_path / "kept.json")["requests"]
    for moved in kept[1:]:
        report = moved["served"]
        assert report["loaded_tokens"] > 0 and moved["image_tokens_loaded"] > 0, moved
        assert report["kept_tokens"] > 0 and report["drift"] is None, report  # unbounded: unknown drift
        assert moved["positions_as_vllm"] is True
    gap = max(
        _largest_gap(o["first_logprobs"], t["first_logprobs"]) for o, t in zip(served, alone, strict=True)
    )
    computed, alone_computed = sum(r["computed"] for r in served), sum(r["computed"] for r in alone)
    print(
        f"images on vLLM's CPU build (demo model): {len(served)} requests over two engines as vLLM alone "
        f"(first tokens equal, largest first-token log-probability gap {gap:.1e}); {computed:.0f} prompt "
        f"tokens computed where vLLM alone computed {alone_computed:.0f}; the second engine loaded "
        f"{sum(r['served']['loaded_tokens'] for r in continued)} tokens, "
        f"{sum(r['image_tokens_loaded'] for r in continued)} of them image tokens; the window reused "
        f"{window['tokens_reused']} tokens with no forward; kept: "
        + ", ".join(
            f"{k['dropped']} dropped: {r['loaded_tokens']} loaded, {r['kept_tokens']} kept"
            for k in kept[1:]
            for r in [k["served"]]
        ),
        file=sys.stderr,
    )
