"""The GPU check of issue 13: SGLang with and without kamera's radix-cache backend, side by side.

For a machine with a GPU and SGLang 0.5.23 (none of ours has both: SGLang's CPU engine needs
Intel AMX). Launches ``python -m sglang.launch_server`` three times on one small VLM checkpoint
(default ``Qwen/Qwen2.5-VL-3B-Instruct``) — SGLang's own radix cache, ``--radix-cache-backend
kamera`` with the exact settings, and with the defaults (``survivors="keep"``) — and sends each
the same sliding-window conversation through the official ``openai`` client: every turn resends
the system prompt and the last ``--window`` screenshots (each a user message with its caption),
drops the oldest, adds a new one and asks a question; greedy, streamed. Reported per server and
turn: time to first token, prompt and cached tokens, and the answer; then whether the exact
server's answers equal SGLang's own (they must) and how often the defaults agree.

    python benchmarks/sglang_gpu_check.py --json sglang_gpu.json
    python benchmarks/sglang_gpu_check.py --dry-run        # the commands and requests only
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

SERVERS = {
    "sglang": None,
    "kamera-exact": '{"survivors": "removal", "rank": "full", "orbit": false}',
    "kamera-defaults": "{}",
}


@dataclass
class Turn:
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    answer: str


@dataclass
class ServerRun:
    name: str
    turns: list[Turn] = field(default_factory=list)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-VL-3B-Instruct")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--window", type=int, default=4, help="screenshots kept in the conversation")
    parser.add_argument("--port", type=int, default=31000)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--dry-run", action="store_true", help="print the launches and requests, run nothing")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    conversations = [_messages(turn, args.window) for turn in range(args.turns)]
    if args.dry_run:
        for i, name in enumerate(SERVERS):
            print(" ".join(_launch(name, args.model, args.port + i)))
        print(f"{len(conversations)} requests, the last with {len(conversations[-1])} messages")
        return {"dry_run": True, "requests": len(conversations)}
    runs = [_run_server(name, args, args.port + i, conversations) for i, name in enumerate(SERVERS)]
    report = _report(runs)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


def _launch(name: str, model: str, port: int) -> list[str]:
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port)]
    command.append("--enable-cache-report")  # usage.prompt_tokens_details.cached_tokens
    return command + (["--radix-cache-backend", "kamera"] if SERVERS[name] is not None else [])


def _run_server(name: str, args: argparse.Namespace, port: int, conversations: list[Any]) -> ServerRun:
    from openai import OpenAI

    env = dict(os.environ)
    if SERVERS[name] is not None:
        env["KAMERA_SGLANG_CONFIG"] = SERVERS[name] or "{}"
    process = subprocess.Popen(_launch(name, args.model, port), env=env)
    try:
        _wait_healthy(port, process)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        run = ServerRun(name)
        for messages in conversations:
            run.turns.append(_ask(client, args.model, messages, args.max_tokens))
            print(f"{name:16} turn {len(run.turns):2}: {run.turns[-1].ttft_ms:8.1f} ms", flush=True)
        return run
    finally:
        process.terminate()
        process.wait(timeout=60)


def _wait_healthy(port: int, process: subprocess.Popen[bytes], timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"the server on port {port} was not healthy after {timeout:.0f} s")


def _ask(client: Any, model: str, messages: list[Any], max_tokens: int) -> Turn:
    start = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage = None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for event in stream:
        if event.choices and event.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(event.choices[0].delta.content)
        usage = event.usage or usage
    details = getattr(usage, "prompt_tokens_details", None)
    return Turn(
        ttft_ms=((first or time.perf_counter()) - start) * 1000,
        prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
        cached_tokens=int(getattr(details, "cached_tokens", 0) or 0),
        answer="".join(pieces),
    )


def _messages(turn: int, window: int) -> list[dict[str, Any]]:
    """System prompt, the last ``window`` screenshots (the oldest dropped each turn), a question."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You watch a desktop; answer briefly."}]
    for shot in range(max(0, turn - window + 1), turn + 1):
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"Screenshot {shot}:"},
                    {"type": "image_url", "image_url": {"url": _screenshot(shot)}},
                ],
            }
        )
    messages.append({"role": "user", "content": "Which window is in front in the last screenshot?"})
    return messages


def _screenshot(index: int) -> str:
    """A synthetic 448×448 desktop: coloured windows whose order and titles change with ``index``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (448, 448), (30, 30, 40))
    draw = ImageDraw.Draw(image)
    colours = [(200, 60, 60), (60, 160, 60), (60, 90, 200), (210, 180, 40)]
    for k in range(4):
        j = (index + k) % 4
        x, y = 40 + 60 * k, 40 + 50 * k
        draw.rectangle([x, y, x + 220, y + 180], fill=colours[j], outline=(255, 255, 255))
        draw.text((x + 8, y + 6), f"window {j} / shot {index}", fill=(255, 255, 255))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _report(runs: list[ServerRun]) -> dict[str, Any]:
    base = runs[0]
    out: dict[str, Any] = {}
    for run in runs:
        same = sum(a.answer == b.answer for a, b in zip(run.turns, base.turns, strict=True))
        later = run.turns[1:] or run.turns
        out[run.name] = {
            "ttft_ms": [t.ttft_ms for t in run.turns],
            "mean_ttft_ms_after_first": sum(t.ttft_ms for t in later) / len(later),
            "prompt_tokens": [t.prompt_tokens for t in run.turns],
            "cached_tokens": [t.cached_tokens for t in run.turns],
            "answers_equal_to_sglang": f"{same}/{len(run.turns)}",
            "answers": [t.answer for t in run.turns],
        }
        print(
            f"{run.name:16} mean TTFT after turn 1 {out[run.name]['mean_ttft_ms_after_first']:8.1f} ms, "
            f"cached {sum(out[run.name]['cached_tokens'])} tokens, answers = SGLang's {same}/{len(run.turns)}"
        )
    return out


if __name__ == "__main__":
    main()
