"""One process of the shared-store tests: a window over the shipped demo model on ``store_url``.

Run as ``python -m tests.store.shared_window_worker URL ORDER [SETTINGS]``: pushes the frames
`frames()` makes in ``ORDER`` (comma-separated indices), reorders them into ascending order,
asks one question, flushes the store and prints one JSON line: the answer, its first-token
logits, the window's costs (pushes, the reorder, the ask) and the store's counters.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from PIL import Image

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.config import WindowConfig
from kamera_agent.demo.model import load_demo_model
from kamera_agent.settings import configure_threads
from kamera_agent.window import KameraWindow

QUESTION = "What is it?"


def frames(count: int = 8) -> list[Image.Image]:
    """Distinct, deterministic frames (every process draws the same pixels)."""
    out = []
    for i in range(count):
        image = Image.new("RGB", (56, 56), (30 * i % 256, 255 - 25 * i, 60 + 20 * i))
        for x in range(0, 56, 8):
            image.putpixel(((x + 7 * i) % 56, (3 * i + x) % 56), (255, 255, 255))
        out.append(image)
    return out


def main(url: str, order: list[int], settings: str) -> None:
    configure_threads(1)
    model, tokenizer, image_processor = load_demo_model()
    config = WindowConfig.exact(store_url=url) if settings == "exact" else WindowConfig(store_url=url)
    window = KameraWindow(model, tokenizer=tokenizer, image_processor=image_processor, config=config)
    images = frames()
    refs = {i: window.push(images[i], label=f"frame {i}") for i in order}
    pushes = window.stats.total
    window.reorder([refs[i] for i in sorted(order)])
    reorder = window.stats.last
    answer = window.ask(QUESTION, decode=DecodeConfig(max_new_tokens=4))
    window.store.close()
    report = {
        "tokens": answer.tokens,
        "first_logits": answer.first_logits.float().tolist(),
        "pushes": asdict(pushes),
        "reorder": asdict(reorder),
        "total": asdict(window.stats.total),
        "store": asdict(window.store.stats()),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(
        sys.argv[1],
        [int(i) for i in sys.argv[2].split(",")],
        sys.argv[3] if len(sys.argv) > 3 else "defaults",
    )
