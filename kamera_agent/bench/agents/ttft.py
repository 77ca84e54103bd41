"""Time to first token after a window op, against its floor: one forward of the query over the
assembled KV.

Why a floor: an ask after an op does three things, placing what changed (relocation, patch
adds), appending it to the assembled cache, and one forward of the query; only the last is
work a prefix cache would also do on a hit. ``ttft / floor`` is what kamera's bookkeeping
costs on top, per op. Where the op ran a forward over the window (a push, a re-formation),
the cache that forward ran over is retained, so the ask after it places nothing (the op paid
the placing, inside ``op_ms``); after a slide alone, the ask places the moved survivors.
The floor is the same query's forward over the same window, timed right after the ask over
a freshly assembled cache (`KameraWindow.kv`; the faster of two runs), so both see the same
machine state; the op's own work (a new chunk's forward, patches formed) is timed beside it.

The window is ``chunks`` random-token pages of ``tokens`` each on the realistic shape, with the
default settings. Each op is repeated and its median kept: an op and its inverse alternate
(append a line, evict it), and a stream step slides the oldest page out as a new one enters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from statistics import median
from typing import Any

import torch
from rich.progress import Progress

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.agents.contents import RandomContents
from kamera_agent.bench.common import wall
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.config import WindowConfig
from kamera_agent.window import KameraWindow

__all__ = ["TTFTRow", "TTFTRun", "TTFTShape", "run_ttft"]

QUESTION = "What changed on the last page?"

_Sample = tuple[int, float, float, float]
"""One run of an op: window tokens placed, then the op's, the first token's and the floor's ms."""


@dataclass(frozen=True)
class TTFTShape:
    """The window timed: ``chunks`` pages of ``tokens`` tokens, lines of ``line`` tokens."""

    chunks: int = 8
    tokens: int = 2048
    line: int = 64
    repeats: int = 3
    stream_steps: int = 2

    @classmethod
    def quick(cls) -> TTFTShape:
        return cls(chunks=4, tokens=64, line=16, repeats=2, stream_steps=2)


@dataclass(frozen=True)
class TTFTRow:
    """One op: its own time, the first token's after it, and the floor, medians over repeats.

    Attributes:
        op: what the op did.
        placed: window tokens the ask after it placed into the cache (``tokens_placed``: moved,
            changed or new chunks; the rest was retained in the assembled cache).
        op_ms: the op itself (its forwards included).
        ttft_ms: the ask after it (``max_new_tokens=1``): placing, appending, the query's forward.
        floor_ms: the query's forward over the assembled window, timed beside it.
        samples: how many times it ran.
    """

    op: str
    placed: int
    op_ms: float
    ttft_ms: float
    floor_ms: float
    samples: int

    @property
    def ratio(self) -> float:
        return self.ttft_ms / self.floor_ms


@dataclass
class TTFTRun:
    """The measurement: its shape, the window it timed, and a row per op."""

    shape: TTFTShape
    window_tokens: int = 0
    rows: list[TTFTRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": asdict(self.shape),
            "window_tokens": self.window_tokens,
            "rows": [{**asdict(row), "ratio": row.ratio} for row in self.rows],
        }


def run_ttft(backend: TransformersBackend, shape: TTFTShape, seed: int, progress: Progress) -> TTFTRun:
    """Fill the window, then time each op and the first token after it (see the module doc)."""
    vocab = int(backend.model.config.vocab_size)
    contents = RandomContents(backend.encoder, {"page": shape.tokens, "line": shape.line}, vocab, seed)
    window = KameraWindow(backend, config=WindowConfig(max_new_tokens=1))
    run = TTFTRun(shape)
    ops = 2 + 2 * shape.repeats + shape.repeats + shape.stream_steps
    task = progress.add_task(f"ttft · {shape.chunks} × {shape.tokens} tokens", total=shape.chunks + ops)
    for index in range(shape.chunks):
        window.push(contents.make("page", index))
        progress.advance(task)
    run.window_tokens = _tokens(window)

    samples: dict[str, list[_Sample]] = {}

    def timed(name: str, op: Callable[[], object]) -> None:
        began = wall()
        op()
        op_ms = (wall() - began) * 1e3
        ttft = _ttft(window)
        placed = window.stats.last.tokens_placed
        floor = min(_floor(window, backend) for _ in range(2))  # the floor's own noise, taken out
        samples.setdefault(name, []).append((placed, op_ms, ttft, floor))
        progress.advance(task)

    timed("first ask (after the pushes)", lambda: None)
    timed("ask again (nothing changed)", lambda: None)
    for index in range(shape.repeats):
        line = contents.make("line", index)
        timed(f"push a {shape.line}-token line", partial(window.push, line))
        timed("evict the last chunk", lambda: window.evict(window.refs[-1]))
    lines = [window.push(contents.make("line", shape.repeats + i)) for i in range(2)]
    for _ in range(shape.repeats):
        timed(
            "swap the last two lines",
            lambda: window.reorder([*window.refs[:-2], window.refs[-1], window.refs[-2]]),
        )
    for ref in lines:
        window.evict(ref)
    for index in range(shape.stream_steps):
        page = contents.make("page", shape.chunks + index)
        timed("stream: slide the oldest page out, push a new one", partial(_stream, window, page))
    run.rows += [_median_row(name, taken) for name, taken in samples.items()]
    return run


def _median_row(op: str, taken: list[_Sample]) -> TTFTRow:
    """The op's row: each figure's median over its runs."""
    placed, op_ms, ttft_ms, floor_ms = zip(*taken, strict=True)
    return TTFTRow(op, int(median(placed)), median(op_ms), median(ttft_ms), median(floor_ms), len(taken))


def _stream(window: KameraWindow, page: Chunk) -> None:
    window.slide()
    window.push(page)


def _ttft(window: KameraWindow) -> float:
    began = wall()
    window.ask(QUESTION, decode=DecodeConfig(max_new_tokens=1))
    return (wall() - began) * 1e3


def _floor(window: KameraWindow, backend: TransformersBackend) -> float:
    """The query's forward (and its next-token logits) over the window's assembled KV."""
    cache = window.kv()
    query_ids = backend.encoder.query_ids(QUESTION)
    end = backend.anchor.advance + sum(window.chunk(ref).advance for ref in window.refs)
    positions = backend.positions.text(end, int(query_ids.shape[0]))
    began = wall()
    with torch.no_grad():
        backend.forward_tokens(query_ids, positions, cache)
    return (wall() - began) * 1e3


def _tokens(window: KameraWindow) -> int:
    return sum(window.chunk(ref).num_tokens for ref in window.refs)
