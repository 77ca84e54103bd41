"""Serve overhead benchmark: a request's own work (outside the model) must not grow with history.

A 30-turn screen-agent conversation (a new screenshot and a question each turn; the client keeps
the last 8 exchanges) through `KameraServer.complete` on the shipped demo model. The backend is
wrapped so every primitive's time (prefill, vision tower, assemble, crop, decode) is summed: a
request's overhead is its wall time less that. Before the server prepared only new messages
(decoding, preprocessing and hashing every image of the history each turn), the overhead grew
with the conversation; now a turn prepares what it has not sent before. Three conversations, side
by side in one run (each on a fresh server); the median per turn, and turn 30 over turn 10.

    python benchmarks/serve_overhead.py                 # 30 turns, 3 runs
    python benchmarks/serve_overhead.py --json overhead.json
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import time
from typing import Any

from PIL import Image
from rich.table import Table

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.common import show_and_save
from kamera_agent.config import WindowConfig
from kamera_agent.demo.model import load_demo_model
from kamera_agent.serve import KameraServer, ServeSettings
from kamera_agent.serve.protocol import ChatRequest
from kamera_agent.settings import configure_threads
from kamera_agent.testing import CountingBackend

MODEL = "kamera-tiny-vl"


def screenshot(i: int) -> dict[str, Any]:
    image = Image.new("RGB", (224, 336), (37 * i % 256, 255 - 29 * i % 256, 90 + 13 * i % 160))
    for x in range(0, 224, 5):
        image.putpixel((x, (11 * i + 3 * x) % 336), (255, 255, 255))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": f"Step {i}: what now?"},
    ]
    return {"role": "user", "content": parts}


def conversation(backend: CountingBackend, turns: int, keep: int) -> list[float]:
    """Each turn's overhead in ms: its wall time in `complete` less the backend's time."""
    server = KameraServer(backend, ServeSettings(MODEL, WindowConfig(), max_tokens=2))
    system = {"role": "system", "content": "You operate a browser. Answer briefly."}
    history: list[dict[str, Any]] = []
    overheads = []
    for i in range(turns):
        messages = [system, *history, screenshot(i)]
        request = ChatRequest(model=MODEL, messages=messages, temperature=0, max_tokens=2)
        model, began = sum(backend.seconds.values()), time.perf_counter()
        done = server.complete(request)
        model = sum(backend.seconds.values()) - model  # the primitives' time within the request
        overheads.append(1e3 * (time.perf_counter() - began - model))
        history += [screenshot(i), {"role": "assistant", "content": done.answer.text or "ok"}]
        del history[: max(0, len(history) - 2 * keep)]
    return overheads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--keep", type=int, default=8, help="exchanges the client keeps")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--early", type=int, default=10, help="the turn compared with the last")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    configure_threads(None)
    model, tokenizer, image_processor = load_demo_model()
    backend = CountingBackend(
        TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)
    )
    runs = [conversation(backend, args.turns, args.keep) for _ in range(args.runs)]
    median = [statistics.median(run[t] for run in runs) for t in range(args.turns)]
    early, last = median[args.early - 1], median[-1]
    table = Table(title=f"kamera serve: a request's own work (ms, median of {args.runs} runs)")
    for column in ("turn", "overhead ms"):
        table.add_column(column, justify="right")
    shown = {1, 2, 5, args.early, args.turns // 2, args.turns - 1, args.turns}
    for turn in sorted(shown & set(range(1, args.turns + 1))):
        table.add_row(str(turn), f"{median[turn - 1]:.2f}")
    table.caption = f"turn {args.turns} / turn {args.early}: {last / early:.2f}x (target <= 1.3x)"
    report = {
        "turns": args.turns,
        "keep": args.keep,
        "runs": runs,
        "median_ms": median,
        "ratio": last / early,
    }
    show_and_save(table, report, args.json)


if __name__ == "__main__":
    main()
