"""vLLM workloads on a real model: `vllm serve` alone against `vllm serve` with kamera's connector.

Why: the connector's claim is fewer prompt tokens computed than vLLM's own prefix cache on the
workloads agents send, with the answers vLLM alone gives. This runs it black-box, as a user
would: vLLM's CPU build (``.venv-vllm/bin/vllm serve``) on SmolLM2-135M-Instruct (its GGUF
file converted once into a Hugging Face folder by kamera's loader: vLLM 0.32 reads no GGUF),
driven by the official ``openai`` client, greedy, one answer token per request, every request
under a ``cache_salt`` (kamera serves kept states only to salted requests). Three workloads of
``--requests`` each, their passages from the benchmark half of kamera's corpus:

Each request ends with a question and the start of its answer, which the model continues
(``continue_final_message``): asked plainly, SmolLM2-135M begins every answer with "The".

- **sliding**: the system prompt, the last ``--window`` passages, the question; each request
  drops the oldest passage and adds one (vLLM's prefix cache holds only the system prompt);
- **rag**: the system prompt, ``--retrieved`` passages drawn from a fixed pool of ``--pool`` in a
  new order each request (a retriever's ranking), the question;
- **handoff**: conversations of ``--turns`` requests growing by a passage each (user passage,
  assistant reply); the first half of each on server A, then A is stopped and the rest runs on
  server B. With kamera both share one store (a loopback Valkey server): B can load what A
  computed.

Two settings run side by side, so both meet the same machine load: vLLM alone (no connector)
and kamera's connector at its defaults (``"kv_connector_extra_config": {"config": {}}``: the
default `WindowConfig`, the store's URL in ``KAMERA_STORE_URL``), each on its own servers. Per
request: prompt tokens, tokens computed and loaded (vLLM's own ``vllm:prompt_tokens_by_source``
on ``/metrics``), kamera's report (``kv_transfer_params["kamera"]``: loaded and kept tokens,
drift, a kept state refused), the first token and the request's wall time; then per workload
the totals and how many first tokens equal vLLM alone's.

The connector serves kept states within the model's calibrated drift budget; the calibration is
filed by the checkpoint's fingerprint, which includes the dtype vLLM serves in. SmolLM2's shipped
calibration is the float32 one, so the servers run ``--dtype float32`` (vLLM's CPU build would
pick bfloat16 for a float32 checkpoint, and find no calibration: it then serves exactly).

    python benchmarks/vllm_workloads.py --requests 100 --json docs/results/engines/smollm2-vllm-workloads.json
    python benchmarks/vllm_workloads.py --dry-run --requests 10   # the prompts' shapes only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kamera_agent.bench.common import show_and_save
from kamera_agent.bench.corpus import passages
from kamera_agent.bench.progress import make_progress
from kamera_agent.bench.vllm_serve import Server, loopback_valkey, vllm_serve

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a careful assistant. Read the passages of the Python Language Reference, answer briefly."
CONNECTOR = {
    "kv_connector": "KameraConnector",
    "kv_connector_module_path": "kamera_agent.engines.vllm.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
"""docs/vllm.md's ``--kv-transfer-config``, less ``kv_connector_extra_config``."""
PASSWORD = "kamera-bench-pass"
WORKLOADS = ("sliding", "rag", "handoff")
SETTINGS = ("alone", "kamera")


@dataclass(frozen=True)
class Request:
    """One request of a workload: which server it goes to (``"a"`` or ``"b"``) and its messages."""

    server: str
    messages: list[dict[str, str]]


def sliding(texts: list[str], requests: int, window: int) -> list[Request]:
    """System, the last ``window`` passages, a question: the oldest dropped each request."""
    return [Request("a", _messages(texts[i : i + window], i)) for i in range(requests)]


def rag(pool: list[str], requests: int, retrieved: int, seed: int) -> list[Request]:
    """System, ``retrieved`` passages of ``pool`` in a new order each request, a question."""
    rng = random.Random(seed)
    return [Request("a", _messages(rng.sample(pool, retrieved), i)) for i in range(requests)]


def handoff(texts: list[str], requests: int, turns: int) -> list[Request]:
    """Conversations of ``turns`` requests, each adding a passage and a reply; each one's first
    half on server A (all of them), then its second half on server B."""
    chats = [texts[c * turns : (c + 1) * turns] for c in range(-(-requests // turns))]
    grown = [[_turn(chat[: t + 1], c * turns + t) for t in range(turns)] for c, chat in enumerate(chats)]
    half = turns // 2
    first = [Request("a", turn) for chat in grown for turn in chat[:half]]
    second = [Request("b", turn) for chat in grown for turn in chat[half:]]
    return first + second[: requests - len(first)]


def _turn(texts: list[str], index: int) -> list[dict[str, str]]:
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for text in texts[:-1]:
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": "Noted."}]
    return [*history, {"role": "user", "content": texts[-1]}, *_question(index)]


def _messages(texts: list[str], index: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        *({"role": "user", "content": text} for text in texts),
        *_question(index),
    ]


def _question(index: int) -> list[dict[str, str]]:
    """The question, and the start of the answer the model continues: asked plainly, this model
    begins every answer with "The", and equal first tokens would say nothing."""
    return [
        {"role": "user", "content": f"Question {index}: which Python feature do these passages describe?"},
        {"role": "assistant", "content": 'The Python feature these passages describe is called "'},
    ]


def workloads(args: argparse.Namespace) -> dict[str, list[Request]]:
    """The three workloads, on disjoint passages (each workload's chunks are its own)."""
    n = args.requests
    texts = passages("benchmark", args.seed, (n + args.window) + args.pool + (n + args.turns))
    slide, rest = texts[: n + args.window], texts[n + args.window :]
    pool, grow = rest[: args.pool], rest[args.pool :]
    return {
        "sliding": sliding(slide, n, args.window),
        "rag": rag(pool, n, args.retrieved, args.seed),
        "handoff": handoff(grow, n, args.turns),
    }


def ask(server: Server, messages: list[dict[str, str]], salt: str) -> dict[str, Any]:
    """One greedy request (one answer token) and where vLLM says its prompt tokens came from."""
    extra = {"cache_salt": salt, "add_generation_prompt": False, "continue_final_message": True}
    done = server.chat(messages, max_tokens=1, extra_body=extra)  # continues `_question`'s answer
    return {
        "prompt_tokens": int(done.body["usage"]["prompt_tokens"]),
        "computed": done.sources["local_compute"],
        "loaded": done.sources["external_kv_transfer"],
        "first_token": done.body["choices"][0]["token_ids"][0],
        "kamera": (done.body.get("kv_transfer_params") or {}).get("kamera"),
        "wall_s": done.wall_s,
    }


@contextmanager
def store(
    args: argparse.Namespace, setting: str
) -> Iterator[tuple[dict[str, Any] | None, dict[str, str] | None]]:
    """``setting``'s ``--kv-transfer-config`` and environment: none for vLLM alone; for kamera the
    connector with ``--config`` and a fresh loopback Valkey server of ``--store-mib``, its URL in
    ``KAMERA_STORE_URL``."""
    if setting == "alone":
        yield None, None
        return
    with loopback_valkey(PASSWORD, args.store_mib << 20) as (_, url):
        config = {"config": json.loads(args.config)}
        yield CONNECTOR | {"kv_connector_extra_config": config}, {"KAMERA_STORE_URL": url}


def serve_flags(args: argparse.Namespace) -> list[str]:
    """``vllm serve``'s options for both settings (the connector's aside)."""
    return [
        *("--dtype", args.dtype, "--enable-prefix-caching", "--max-model-len", str(args.max_model_len)),
        *("--block-size", "32", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0"),
    ]


def run_setting(
    args: argparse.Namespace,
    folder: Path,
    logs: Path,
    setting: str,
    plan: dict[str, list[Request]],
    progress: Any,
) -> dict[str, Any]:
    """Every workload through ``setting``: server A runs every request sent to A, then is stopped
    and server B (on the same store) runs the hand-off's rest. Per request its record; each
    server's kamera counters and whether its log says the model has no calibration."""
    tasks = {
        name: progress.add_task(f"{setting}: {name}", total=len(requests)) for name, requests in plan.items()
    }
    out: dict[str, Any] = {name: {"requests": []} for name in plan}
    out["counters"] = {}
    with store(args, setting) as (transfer, env):
        for server in ("a", "b"):
            log = logs / f"{setting}-{server}.log"
            with vllm_serve(
                args.vllm, folder, log, serve_flags(args), root=ROOT, transfer=transfer, env=env
            ) as vllm:
                for name, requests in plan.items():
                    for request in (r for r in requests if r.server == server):
                        out[name]["requests"].append(ask(vllm, request.messages, f"kamera-bench-{name}"))
                        progress.advance(tasks[name])
                        _save(args, setting, out)
                out["counters"][server] = vllm.counters()
    out["uncalibrated"] = {name: _uncalibrated(logs / f"{setting}-{name}.log") for name in ("a", "b")}
    return out


def _save(args: argparse.Namespace, setting: str, out: dict[str, Any]) -> None:
    """What ``setting`` measured so far, beside ``--json`` (a run cut short keeps its figures)."""
    if args.json:
        partial = Path(f"{args.json}.{setting}.partial")
        partial.with_suffix(".tmp").write_text(json.dumps(out))
        partial.with_suffix(".tmp").replace(partial)  # whole, for a reader while the run goes on


def _uncalibrated(log: Path) -> bool:
    """The server's log has kamera's `UncalibratedWarning` (the model's fingerprint at this
    dtype has no calibration: the connector serves exactly)."""
    return bool(re.search(r"has no drift calibration", log.read_text(errors="replace")))


def totals(alone: dict[str, Any], kamera: dict[str, Any]) -> dict[str, Any]:
    """Per workload: tokens computed both sides, loaded, kept, refusals, first tokens equal, wall."""
    rows: dict[str, Any] = {}
    for name in WORKLOADS:
        mine, theirs = kamera[name]["requests"], alone[name]["requests"]
        reports = [r["kamera"] or {} for r in mine]
        rows[name] = {
            "requests": len(mine),
            "prompt_tokens": sum(r["prompt_tokens"] for r in mine),
            "computed_alone": sum(r["computed"] for r in theirs),
            "computed_kamera": sum(r["computed"] for r in mine),
            "loaded": sum(r["loaded"] for r in mine),
            "kept_tokens": sum(int(r.get("kept_tokens", 0)) for r in reports),
            "kept_refused": sum(bool(r.get("kept_refused")) for r in reports),
            "distinct_first_tokens": len({r["first_token"] for r in theirs}),
            "equal_first_tokens": sum(
                a["first_token"] == b["first_token"] for a, b in zip(mine, theirs, strict=True)
            ),
            "wall_alone_s": sum(r["wall_s"] for r in theirs),
            "wall_kamera_s": sum(r["wall_s"] for r in mine),
        }
        rows[name]["ratio"] = rows[name]["computed_kamera"] / max(1, rows[name]["computed_alone"])
        rows[name]["agreement"] = rows[name]["equal_first_tokens"] / max(1, len(mine))
    return rows


def table(rows: dict[str, Any], title: str) -> Table:
    shown = Table(title=title)
    columns: tuple[str, ...] = (
        "workload",
        "requests",
        "prompt tok",
        "computed alone",
        "computed kamera",
        "ratio",
    )
    columns += ("loaded", "kept tok", "refused", "first tok equal", "wall alone s", "wall kamera s")
    for column in columns:
        shown.add_column(column, justify="right")
    for name, row in rows.items():
        equal = f"{row['equal_first_tokens']}/{row['requests']} ({100 * row['agreement']:.1f} %)"
        shown.add_row(
            name,
            *(str(row[k]) for k in ("requests", "prompt_tokens", "computed_alone", "computed_kamera")),
            f"{row['ratio']:.3f}",
            *(str(row[k]) for k in ("loaded", "kept_tokens", "kept_refused")),
            equal,
            f"{row['wall_alone_s']:.0f}",
            f"{row['wall_kamera_s']:.0f}",
        )
    return shown


def shapes(plan: dict[str, list[Request]]) -> dict[str, Any]:
    """What each workload sends, request by request: its server and each message's role and the
    first 12 hex digits of its text's SHA-256 (what ``--dry-run`` writes)."""
    return {
        name: [{"server": r.server, "messages": [_named(m) for m in r.messages]} for r in requests]
        for name, requests in plan.items()
    }


def _named(message: dict[str, str]) -> str:
    return f"{message['role']}:{hashlib.sha256(message['content'].encode()).hexdigest()[:12]}"


def checkpoint(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The folder vLLM serves (the GGUF converted once, or a folder as given) and whether kamera
    has a calibration for its fingerprint at the served dtype."""
    from kamera_agent.checkpoints import resolve_checkpoint
    from kamera_agent.fidelity import find_calibration
    from kamera_agent.fingerprint import checkpoint_fingerprint

    folder = resolve_checkpoint(args.model).folder
    fingerprint = checkpoint_fingerprint(folder, args.dtype)
    calibration = find_calibration(fingerprint)
    found = {"fingerprint": fingerprint, "calibrated": calibration is not None}
    return folder, found | ({"epsilon": calibration.budget} if calibration is not None else {})


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or a folder (default: SmolLM2's GGUF)")
    parser.add_argument("--vllm", type=Path, default=ROOT / ".venv-vllm" / "bin" / "vllm")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--config", default="{}", help="the connector's WindowConfig fields, JSON")
    parser.add_argument("--requests", type=int, default=100, help="requests per workload")
    parser.add_argument("--window", type=int, default=3, help="sliding: passages kept")
    parser.add_argument("--pool", type=int, default=6, help="rag: passages retrievable")
    parser.add_argument("--retrieved", type=int, default=3, help="rag: passages per request")
    parser.add_argument("--turns", type=int, default=10, help="handoff: requests per conversation")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--store-mib", type=int, default=1024, help="the Valkey server's maxmemory (LRU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="build the workloads, run nothing")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    if args.retrieved > args.pool or not 2 <= args.turns <= args.requests:
        parser.error("need --retrieved <= --pool and 2 <= --turns <= --requests")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    plan = workloads(args)
    if args.dry_run:
        if args.json:
            Path(args.json).write_text(json.dumps({"shapes": shapes(plan)}, indent=2))
        return {"shapes": shapes(plan)}
    if args.model is None:
        from kamera_agent.models.real import real_model_gguf

        args.model = str(real_model_gguf("smollm2"))
    folder, calibration = checkpoint(args)
    with (
        tempfile.TemporaryDirectory(prefix="kamera-vllm-") as logs,
        make_progress(Console(stderr=True)) as progress,
        ThreadPoolExecutor(len(SETTINGS)) as pool,
    ):  # side by side: both settings meet the same machine load at the same time
        jobs = {s: pool.submit(run_setting, args, folder, Path(logs), s, plan, progress) for s in SETTINGS}
        runs = {setting: job.result() for setting, job in jobs.items()}
    rows = totals(runs["alone"], runs["kamera"])
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "serve": {"flags": serve_flags(args), "connector": CONNECTOR, "config": json.loads(args.config)},
        "checkpoint": {"model": Path(args.model).name, "folder": folder.name, **calibration},
        "uncalibrated_logged": {s: runs[s]["uncalibrated"] for s in runs},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "vllm", "model")},
        "machine": {"cpu_count": os.cpu_count(), "processor": _processor()},
        "totals": rows,
        "counters": {s: runs[s]["counters"] for s in runs},
        "runs": {s: {w: runs[s][w] for w in WORKLOADS} for s in runs},
    }
    title = f"vllm serve on {Path(args.model).name} ({args.dtype}), alone vs kamera's connector {args.config}"
    return show_and_save(table(rows, title), report, args.json)


def _processor() -> str:
    """The CPU's model name (``/proc/cpuinfo``), where the platform has one."""
    info = Path("/proc/cpuinfo")
    names = re.findall(r"^model name\s*:\s*(.+)$", info.read_text(), re.MULTILINE) if info.exists() else []
    return names[0] if names else ""


if __name__ == "__main__":
    main()
