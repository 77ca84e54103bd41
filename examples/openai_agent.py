"""A screen agent on the official ``openai`` client, served by ``kamera serve``.

The agent does what agent frameworks do: every step it resends the whole conversation, now
with a new screenshot, and keeps only the newest three screenshots (the oldest exchange is
dropped). A prefix cache misses from the first changed byte of such a request: once an exchange
is dropped, everything after it. kamera serve turns the change into window edits in one
`arrange` (the dropped exchange evicted, the new screenshot admitted) and says so: each turn
prints ``usage.prompt_tokens_details.cached_tokens`` and the ops the server ran. At the
defaults on the demo model, whose chunks bind to what precedes them, the drift budget re-forms
the survivors of each drop, so from the first drop on a request costs what a prefix cache's
does; with the policies unbounded it would reuse them. The answer streams.

    kamera serve &                                   # the shipped demo model on 127.0.0.1:8000
    .venv/bin/python examples/openai_agent.py --base-url http://127.0.0.1:8000/v1
    .venv/bin/python examples/openai_agent.py                  # starts a server of its own for the run
"""

from __future__ import annotations

import argparse
import base64
import io
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import IO, Any

from openai import OpenAI
from PIL import Image

from kamera_agent.demo.task import QUESTIONS, make_items, render_page

MODEL = "kamera-tiny-vl"
SYSTEM = "Answer briefly."


def screenshot_url(step: int) -> str:
    """Step ``step``'s screen as a data: URL (a demo page: glyphs the demo model can read)."""
    item = make_items(1, seed=1000 + step)[0]
    image: Image.Image = render_page(item.pages[0])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def run(client: OpenAI, steps: int, keep: int = 3, model: str = MODEL) -> list[Any]:
    """The agent loop; returns each step's final stream event with usage (for callers' checks)."""
    history: list[dict[str, Any]] = []
    usages = []
    for step in range(steps):
        screen = {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": screenshot_url(step)}},
                {"type": "text", "text": QUESTIONS["glyph"]},
            ],
        }
        messages = [{"role": "system", "content": SYSTEM}, *history, screen]
        stream = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, ops = "", None, []
        for event in stream:
            if event.choices:
                text += event.choices[0].delta.content or ""
                ops = (event.model_extra or {}).get("kamera", {}).get("ops", ops)
            if event.usage is not None:
                usage = event.usage
        assert usage is not None
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        done = ", ".join(f"{op['op']}({op['tokens_prefilled']}{_edited(op)})" for op in ops)
        print(f"step {step}: {text!r:10} prompt {usage.prompt_tokens:4} cached {cached:4}  ops: {done}")
        usages.append(usage)
        history += [screen, {"role": "assistant", "content": text or "."}]
        if len(history) > 2 * keep:
            del history[:2]  # the oldest screenshot and its answer leave the conversation
    return usages


def _edited(op: dict[str, Any]) -> str:
    """An op's edits beyond plain relocation, e.g. ``: evict 1, push 2``."""
    edits = op.get("edits") or {}
    return (": " + ", ".join(f"{kind} {n}" for kind, n in sorted(edits.items()))) if edits else ""


def main(argv: list[str] | None = None) -> list[Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", help="a running kamera serve (default: start one for this run)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default=MODEL, help="the served model's id")
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the server's start (default 300)",
    )
    args = parser.parse_args(argv)
    if args.base_url:
        return run(OpenAI(base_url=args.base_url, api_key="unused"), args.steps, model=args.model)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryFile() as log:  # the server's output, shown if it fails to start
        server = subprocess.Popen(
            [sys.executable, "-m", "kamera_agent", "--threads", "1", "serve", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_for(f"http://127.0.0.1:{port}/health", server, log, args.start_timeout)
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
            return run(client, args.steps, model=args.model)
        finally:
            server.terminate()
            server.wait(timeout=20)


def _wait_for(url: str, server: subprocess.Popen[bytes], log: IO[bytes], seconds: float) -> None:
    """Poll ``url`` while the server process lives (loading the model takes seconds to minutes on
    a busy machine); if it exits or ``seconds`` pass, say which, with the tail of its output."""
    began = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            code, waited = server.poll(), time.monotonic() - began
            if code is not None or waited > seconds:
                log.seek(0)
                tail = log.read().decode(errors="replace").strip().splitlines()[-15:]
                why = (
                    f"it exited with status {code}"
                    if code is not None
                    else f"it did not answer {url} within {seconds:.0f} s (a busy machine: pass "
                    "--start-timeout, or start `kamera serve` yourself and pass --base-url)"
                )
                raise RuntimeError("kamera serve did not start: " + why + "\n" + "\n".join(tail)) from None
            time.sleep(0.2)


if __name__ == "__main__":
    main()
