"""`vllm serve` with the connector and no store URL: its processes share the default disk store.

``vllm serve`` runs its scheduler and its worker in processes of their own. Without a store
URL each used to open a memory store of its own, so the scheduler side knew the worker's
captures only from the worker's reports, for 30 s (a replay after 1.5 s loaded 1,088 of 1,114
tokens, after 35 s none). Now both open the engines' default store, one disk folder of the
machine (`kamera_agent.engines.stores`), named in the server's log.

"Later" by construction: the scheduler side's only memory of what its workers filed lasts
`FILED_FOR` seconds (`kamera_agent.engines.shards`); the replay runs after it has expired, so
what serves it is the store alone, as it would be a minute or a day later (the 30 s window of
before, long past too, would have served nothing).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from kamera_agent.engines.shards import FILED_FOR
from kamera_agent.engines.stores import STORE_DIR_VARIABLE
from tests.engines.vllm.serve import CONNECTOR, ask, sliding, vllm_serve
from tests.engines.vllm.test_connector import model_dir  # noqa: F401  (the tiny checkpoint fixture)

pytestmark = pytest.mark.vllm


def test_vllm_serve_without_a_store_url_reuses_its_own_captures_later(
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    stores, log = tmp_path / "stores", tmp_path / "serve.log"
    transfer = CONNECTOR | {"kv_connector_extra_config": {}}  # the exact settings, no store named
    with vllm_serve(model_dir, log, transfer, env={STORE_DIR_VARIABLE: str(stores)}) as server:
        conversation = [ask(server, messages) for messages in sliding()[:3]]
        time.sleep(FILED_FOR + 0.5)  # the scheduler side's memory of its workers' filings is gone
        server.reset_prefix_cache()
        replay = ask(server, sliding()[2])
        counters = server.counters()
    (folder,) = stores.iterdir()  # one folder for the model
    assert f"share the disk store in {folder}" in log.read_text()  # the log names it
    assert (folder / "index.sqlite").exists() and list(folder.glob("*.safetensors"))
    # vLLM's own prefix cache was reset: the conversation's chunks came from the default store
    assert replay["external_kv_transfer"] > 0 and replay["tokens"] == conversation[2]["tokens"]
    assert counters["vllm:kamera_loaded_tokens_total"] == replay["external_kv_transfer"]
    assert counters["vllm:kamera_failed_loads_total"] == 0
    assert counters.get("vllm:kamera_faults_total", 0) == 0
    print(
        f"vllm serve without a store URL: after /reset_prefix_cache, {FILED_FOR + 0.5:.1f} s on, the "
        f"replay loaded {replay['external_kv_transfer']:.0f} of {replay['prompt_tokens']} prompt tokens "
        f"from {folder}",
        file=sys.stderr,
    )
