"""Window memory benchmark: what a window keeps of the images that slid out, side by side.

A window used to keep every chunk ever pushed with its preprocessed pixels. Now an evicted image
releases its pixels once its vision output or canonical is stored (``evicted_pixels="drop"``,
the default), and ``max_evicted`` bounds how many evicted chunks stay recallable. This streams
``--images`` random frames through a window of ``--capacity`` chunks on the shipped demo model
(56×56 frames, as a screen or video agent would push them) under three settings in one run and
prints the bytes of pixels the window holds, the chunks it remembers and the store's bytes:

- ``keep``: ``evicted_pixels="retain"``, ``max_evicted=None`` (the old behaviour);
- ``drop``: ``evicted_pixels="drop"``, ``max_evicted=None``;
- ``defaults``: ``evicted_pixels="drop"``, ``max_evicted=1024``.

    python benchmarks/window_memory.py                 # 1500 images, capacity 8
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from PIL import Image
from rich.table import Table

from kamera_agent.bench.common import show_and_save
from kamera_agent.config import WindowConfig
from kamera_agent.demo import load_demo_model
from kamera_agent.settings import configure_threads
from kamera_agent.window import KameraWindow

SETTINGS: dict[str, dict[str, Any]] = {
    "keep": {"evicted_pixels": "retain", "max_evicted": None},
    "drop": {"evicted_pixels": "drop", "max_evicted": None},
    "defaults": {},
}


def stream(images: int, capacity: int, settings: dict[str, Any], seed: int) -> dict[str, float]:
    model, tokenizer, image_processor = load_demo_model()
    config = WindowConfig(rank=4, capacity_chunks=capacity, **settings)
    window = KameraWindow(model, tokenizer=tokenizer, image_processor=image_processor, config=config)
    rng = np.random.default_rng(seed)
    began = time.perf_counter()
    for _ in range(images):
        window.push(Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)))
    held = [window.chunk(ref) for ref in [*window.refs, *window.evicted]]
    pixels = sum(
        c.pixel_values.numel() * c.pixel_values.element_size() for c in held if c.pixel_values is not None
    )
    return {
        "pixel_mb": pixels / 1e6,
        "chunks_remembered": len(held),
        "forgotten": window.stats.total.forgotten,
        "store_mb": window.store.stats().memory_bytes / 1e6,
        "seconds": time.perf_counter() - began,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1500)
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    configure_threads(1)
    rows = {
        name: stream(args.images, args.capacity, settings, args.seed) for name, settings in SETTINGS.items()
    }
    table = Table(title=f"{args.images} frames through a window of {args.capacity} (demo model, 1 thread)")
    for column in ("settings", "pixels held", "chunks remembered", "forgotten", "store (memory)", "time"):
        table.add_column(column, justify="right")
    for name, row in rows.items():
        table.add_row(
            name,
            f"{row['pixel_mb']:.1f} MB",
            str(row["chunks_remembered"]),
            str(row["forgotten"]),
            f"{row['store_mb']:.1f} MB",
            f"{row['seconds']:.1f} s",
        )
    report = {"images": args.images, "capacity": args.capacity, "rows": rows}
    return show_and_save(table, report, args.json)


if __name__ == "__main__":
    main()
