"""Video agent: a sliding window over the last k frames of a video, recalling frames on demand.

Frames are read with OpenCV (`kamera_agent.chunks.read_video`); without ``--video`` the example
writes its own clip of the demo task's glyph frames. Each frame is pushed into a window of
``capacity_chunks=k`` (the oldest slides out) and a question is asked at every step. When a
question refers back to a frame that has slid out ("frame #2"), that frame is recalled from the
store: no vision encode. Survivors and the recalled frame are relocated, and at the defaults
whatever the drift budget expects past the model's ε is re-formed by a forward over its left
context: on the demo model, whose frames bind to what precedes them, that is every slide and
recall, so those rows cost what a prefix cache's do. The table shows every op's cost beside what
a prefix cache and a full re-prefill would prefill (`_shared.py`); each answer is printed beside
the model's own re-prefill's first token, so a wrong answer of the tiny demo model is not
mistaken for kamera's.

    .venv/bin/python examples/video_agent.py                          # demo model, its own 8-frame clip
    .venv/bin/python examples/video_agent.py --video clip.mp4 --model path/to/Qwen2.5-VL-3B-Instruct
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
from _shared import CostLog, example_parser, open_window

from kamera_agent import ChunkRef, Plan, WindowConfig
from kamera_agent.chunks import read_video
from kamera_agent.demo.task import GLYPHS, PAGE_CELLS, render_page


@dataclass(frozen=True)
class VideoRun:
    """What the loop did: every op's cost, each (question, answer), and each recall's plan."""

    log: CostLog
    answers: list[tuple[str, str]]
    recalls: dict[str, Plan]
    glyphs: list[str]  # what the example's own clip shows in each frame (empty for --video)


def write_clip(path: Path, frames: int, fps: float = 2.0) -> list[str]:
    """Write ``frames`` frames (demo pages filled with one glyph, MJPG) to ``path``; returns the
    glyph of each."""
    glyphs = [list(GLYPHS)[(3 * i) % len(GLYPHS)] for i in range(frames)]
    pages = [render_page([glyph] * PAGE_CELLS) for glyph in glyphs]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), fps, pages[0].size)
    for page in pages:
        writer.write(cv2.cvtColor(np.asarray(page), cv2.COLOR_RGB2BGR))
    writer.release()
    return glyphs


def question(n: int, back: int, capacity: int) -> str:
    """About the newest frame, except once frame ``#back`` has just slid out: then about it."""
    return f"Which glyph is in frame #{back if n == back + capacity else n}?"


def main(argv: list[str] | None = None) -> VideoRun:
    parser = example_parser(__doc__)
    parser.add_argument("--video", type=Path, help="a video file (default: write a glyph clip)")
    parser.add_argument("--frames", type=int, default=8, help="frames to read (default: 8)")
    parser.add_argument("--capacity", type=int, default=4, help="frames the window keeps (default: 4)")
    parser.add_argument("--back", type=int, default=2, help="the frame a later question refers to")
    args = parser.parse_args(argv)
    # evicted frames keep their pixels so that the model's own re-prefill can check every answer
    config = WindowConfig(
        capacity_chunks=args.capacity, max_new_tokens=args.max_new_tokens, evicted_pixels="retain"
    )
    window = open_window(args, config)
    log, answers, recalls, glyphs, truth = CostLog(), [], {}, [], []
    frames: dict[int, ChunkRef] = {}
    with tempfile.TemporaryDirectory() as tmp:
        video = args.video or Path(tmp) / "glyphs.avi"
        if args.video is None:
            glyphs = write_clip(video, args.frames)
        for n, frame in enumerate(read_video(video, max_frames=args.frames), start=1):
            before = set(window.refs)
            frames[n] = window.push(frame, caption=f"#{n}", label=f"#{n}")
            gone = ", ".join(ref.label for ref in before - set(window.refs))
            log.record(n, "push", f"#{n}" + (f", {gone} out" if gone else ""), window)
            query = question(n, args.back, args.capacity)
            k = int(re.findall(r"#(\d+)", query)[0])
            ref = frames[k]
            if ref in window.evicted:  # slid out: back from the store, with no vision encode
                recalls[ref.label] = window.plan.recall(ref)
                window.recall(ref)
                log.record(n, "recall", ref.label, window)
            answers.append((query, window.ask(query).text))
            chunks = [window.chunk(r) for r in window.refs]
            reference = window.backend.reference_prefill(chunks, window.query_ids(query))
            first = window.encoder.tokenizer.decode([int(reference.logits.argmax())])
            shows = f"; the clip shows {glyphs[k - 1]!r}" if glyphs else ""
            truth.append(f" (re-prefill's first token: {first!r}{shows})")
            log.record(n, "ask", f"about {ref.label}", window, query)
    log.print(f"video agent: window of {args.capacity} frames")
    for label, plan in recalls.items():
        print(f"recall {label}: " + "; ".join(f"{e.kind} {e.label} ({e.detail})" for e in plan.edits))
    for (query, text), shows in zip(answers, truth, strict=True):
        print(f"{query} -> {text!r}{shows}")
    return VideoRun(log, answers, recalls, glyphs)


if __name__ == "__main__":
    main()
