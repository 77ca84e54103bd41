"""Entries lost or unreadable between vLLM's offer and its load, on vLLM's own engine (CPU build).

`lost_scenario.py` runs one engine in a fresh interpreter: a conversation is captured, then the
store claims those entries while losing them (gone when read) or spoiling them (every read
fails). Two requests holding them arrive together and are offered them in one step; every load
fails. Before this, vLLM re-offered the same tokens every step for ~30 s (lost) or without end
(unreadable); now each request is computed after its first failed load, each entry is offered at
most twice (here: once to each of the two requests), the faults are counted on vLLM's own
metrics, and the requests' captures file the entries anew, so the next request is served.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kamera_agent.engines.stores import STORE_DIR_VARIABLE
from tests.engines.vllm.test_connector import model_dir  # noqa: F401  (the tiny checkpoint fixture)

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def report(model_dir: Path) -> dict[str, Any]:  # noqa: F811
    out = model_dir / "lost.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # this checkout: `-m` from ROOT
    env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env[STORE_DIR_VARIABLE] = str(model_dir / "stores-lost")  # the run's own default store
    command = [sys.executable, "-m", "tests.engines.vllm.lost_scenario", "--model", str(model_dir)]
    done = subprocess.run(
        [*command, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return dict(json.loads(out.read_text()))


@pytest.mark.parametrize("loss", ["lost", "unreadable"])
def test_a_failed_load_is_counted_and_its_request_computed_at_once(report: dict[str, Any], loss: str) -> None:
    assert report["kamera"] == str(ROOT / "kamera_agent")  # this checkout's code ran
    alone, run = report["alone"], report[loss]
    failed = run["failed"]
    # one offer to each of the two requests (in one step, before any load ran), then none: each
    # request was computed after its first failed load, each entry offered twice in all
    assert failed["offers"] == 2, failed
    entries = len(failed["reads"])  # the captured chunks the requests hold (the question is not)
    assert 0 < entries < failed["captured"], failed
    assert failed["external_kv_transfer"] == 0 and failed["local_compute"] > 0  # computed by vLLM
    kind = "LostEntry" if loss == "lost" else "UnreadableEntry"
    assert failed["faults"] == {f"start_load_kv:{kind}": 2 * entries}, failed["faults"]  # a load each
    assert failed["faults_metric"] == 2 * entries  # on vllm:kamera_faults too
    assert failed["answers"] == [alone[1][0], alone[2][0]]
    # their captures filed the entries anew: the next request is served them, and answers as alone
    again = run["again"]
    assert again["external_kv_transfer"] > 0 and again["answers"] == alone[1]
    assert again["faults"] == {}  # every load of it written
    print(
        f"{loss} entries: {entries} entries, {failed['offers']} offers (two requests, one step), "
        f"{sum(failed['faults'].values())} failed loads counted, then computed "
        f"({failed['local_compute']:.0f} prompt tokens, none external); filed anew, the next request "
        f"loaded {again['external_kv_transfer']:.0f}; answers as vLLM alone",
        file=sys.stderr,
    )
