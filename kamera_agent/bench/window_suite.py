"""Window suite: a long scripted agent episode through KameraWindow against a real prefix cache.

Why an episode: what an agent pays is the sum over its window's life. The episode pushes the
demo task's frames into a window of bounded capacity (the oldest leave when it is full), slides,
reorders blocks of frames and recalls evicted ones, deterministically from one seed. After
every op the prefix cache (`PrefixCache`) is brought to the same sequence, in the same
process, and both costs are recorded: tokens prefilled, forwards and wall time, op by op.
Frames are rendered and preprocessed before either side's clock starts.

At the end both are checked against the model's own re-prefill of the final window: the
baseline must match it (it is exact by construction), and kamera's next-token KL is reported.
The prefix cache keeps vision-tower outputs by content, as vLLM and SGLang do, so neither side
re-runs the vision tower for pixels it has seen; what differs is the language model's work.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any

import torch
from rich.progress import Progress

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.common import finite
from kamera_agent.bench.prefix_cache import PrefixCache
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.config import WindowConfig
from kamera_agent.demo.task import QUESTIONS, Page, make_items, render_legend, render_page
from kamera_agent.window import KameraWindow

__all__ = ["POLICIES", "OpRecord", "WindowRun", "run_window"]

_WEIGHTS = {"push": 0.35, "slide": 0.15, "reorder": 0.25, "recall": 0.25}
POLICIES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "default": MappingProxyType({}),
        "exact": MappingProxyType(
            {"orbit": False, "survivors": "removal", "recall_context": "current", "cascade": "cascade"}
        ),
    }
)
"""Window settings the episode runs under: the defaults (survivors keep what they absorbed from
evicted chunks, recalls use their original context, orbit patches across reorders) trade
exactness for forwards; ``exact`` re-patches whatever a re-prefill would compute differently."""
_QUERY = QUESTIONS["colour"]


@dataclass(frozen=True)
class OpRecord:
    """One op of the episode and what each side paid for it."""

    op: str
    detail: str
    chunks: int
    kamera_tokens: int
    kamera_forwards: int
    kamera_ms: float
    baseline_tokens: int
    baseline_forwards: int
    baseline_ms: float
    kamera_vision: int = 0
    baseline_vision: int = 0


@dataclass
class WindowRun:
    """The suite's live state: a record per finished op, then the end-of-episode checks.

    Attributes:
        baseline_logit_error: max |logit difference| between the prefix cache's next-token
            logits and the model's own re-prefill of the final window (should be ~0).
        kamera_kl: next-token KL of kamera's window to that re-prefill.
    """

    seed: int
    ops_requested: int
    capacity: int
    rank: int
    policy: str = "default"
    records: list[OpRecord] = field(default_factory=list)
    baseline_logit_error: float = float("nan")
    kamera_kl: float = float("nan")

    def total(self, name: str) -> float:
        return float(sum(getattr(record, name) for record in self.records))

    def cumulative(self, name: str) -> list[float]:
        running, out = 0.0, []
        for record in self.records:
            running += getattr(record, name)
            out.append(running)
        return out

    def to_json(self) -> dict[str, Any]:
        names = ("kamera_tokens", "baseline_tokens", "kamera_ms", "baseline_ms")
        totals = {name: self.total(name) for name in (*names, "kamera_vision", "baseline_vision")}
        return {
            "seed": self.seed,
            "ops_requested": self.ops_requested,
            "ops_done": len(self.records),
            "capacity_chunks": self.capacity,
            "rank": self.rank,
            "policy": self.policy,
            "settings": dict(POLICIES[self.policy]),
            "ops": {op: sum(r.op == op for r in self.records) for op in _WEIGHTS},
            "totals": totals,
            "baseline_logit_error": finite(self.baseline_logit_error),
            "kamera_kl": finite(self.kamera_kl),
            "records": [vars(record) for record in self.records],
        }


def run_window(model: Any, tokenizer: Any, image_processor: Any, run: WindowRun, progress: Progress) -> None:
    """Run the episode on a fresh window (its own store: nothing carried over from other suites).

    Mutates: ``run`` (a record per op, then the final checks).
    """
    config = WindowConfig(  # keep pixels: the prefix cache re-prefills recalled frames from them
        rank=run.rank,
        capacity_chunks=run.capacity,
        max_new_tokens=1,
        evicted_pixels="keep",
        **POLICIES[run.policy],
    )
    window = KameraWindow(model, tokenizer=tokenizer, image_processor=image_processor, config=config)
    backend = window.backend
    assert isinstance(backend, TransformersBackend)
    baseline, episode = PrefixCache(backend), _Episode(window, backend.encoder, random.Random(run.seed))
    task = progress.add_task(
        f"window ({run.policy}) · {run.ops_requested} ops vs prefix cache", total=run.ops_requested
    )
    for _ in range(run.ops_requested):
        move = episode.next()
        began = time.perf_counter()
        move.run()
        kamera_s, cost = time.perf_counter() - began, window.stats.last
        synced = baseline.sync([window.chunk(ref) for ref in window.refs])
        run.records.append(
            OpRecord(
                move.op,
                move.detail,
                len(window),
                cost.tokens_prefilled,
                cost.forwards,
                kamera_s * 1e3,
                synced.tokens,
                synced.forwards,
                synced.seconds * 1e3,
                cost.vision_encodes,
                synced.vision_runs,
            )
        )
        progress.advance(task)
    _final_checks(window, baseline, run)


def _final_checks(window: KameraWindow, baseline: PrefixCache, run: WindowRun) -> None:
    """Both sides' next-token logits for a question over the final window against re-prefill."""
    backend = window.backend
    assert isinstance(backend, TransformersBackend)
    with torch.no_grad():
        reference = backend.model(**window.as_model_inputs(_QUERY)).logits[0, -1].float()
    kamera = window.ask(_QUERY, max_new_tokens=1).first_logits.float()
    ours = baseline.first_logits(backend.encoder.query_ids(_QUERY))
    run.baseline_logit_error = float((ours - reference).abs().max())
    p, q = torch.log_softmax(reference.double(), -1), torch.log_softmax(kamera.double(), -1)
    run.kamera_kl = max(0.0, float((p.exp() * (p - q)).sum()))


@dataclass(frozen=True)
class _Move:
    """The next op, fully prepared (frames rendered and preprocessed): ``run`` is what is timed."""

    op: str
    detail: str
    run: Callable[[], object]


class _Episode:
    """Draws the next op from the window's state (deterministic given the seed)."""

    def __init__(self, window: KameraWindow, encoder: ChunkEncoder, rng: random.Random) -> None:
        self.window, self.encoder, self.rng = window, encoder, rng
        frames: list[tuple[str, Callable[[], Chunk]]] = []
        for n, item in enumerate(make_items(40, seed=rng.randrange(1 << 30))):
            for i, entries in enumerate(item.legend, start=1):
                frames.append((f"legend {n}.{i}", partial(self._legend, entries)))
            for k, cells in enumerate(item.pages, start=1):
                frames.append((f"page {n}.{k}", partial(self._page, cells, k)))
        rng.shuffle(frames)
        self.frames, self.next_frame = frames, 0

    def _legend(self, entries: tuple[tuple[str, str], ...]) -> Chunk:
        return self.encoder.image(render_legend(entries))

    def _page(self, cells: Page, k: int) -> Chunk:
        return self.encoder.image(render_page(cells), kind="frame", caption=f"#{k}")

    def next(self) -> _Move:
        ops, weights = zip(*_WEIGHTS.items(), strict=True)
        op = self.rng.choices(ops, weights)[0]
        size = len(self.window)
        if (op == "slide" and size < 4) or (op == "reorder" and size < 3):
            op = "push"
        if op == "recall" and not self._recallable():
            op = "push"
        moves = {"push": self._push, "slide": self._slide, "reorder": self._reorder, "recall": self._recall}
        return moves[op]()

    def _push(self) -> _Move:
        in_window = {ref.label for ref in self.window.refs}
        while True:
            label, make = self.frames[self.next_frame % len(self.frames)]
            self.next_frame += 1
            if label not in in_window:
                break
        chunk = make()
        return _Move("push", label, lambda: self.window.push(chunk, label=label))

    def _recallable(self) -> bool:
        in_window = {ref.label for ref in self.window.refs}
        return any(ref.label not in in_window for ref in self.window.evicted)

    def _slide(self) -> _Move:
        n = self.rng.choice((1, 2))
        return _Move("slide", f"{n} oldest out", lambda: self.window.slide(n))

    def _reorder(self) -> _Move:
        order = self.window.refs
        width = self.rng.randint(2, min(4, len(order)))
        first = self.rng.randint(0, len(order) - width)
        block = order[first : first + width]
        shuffled = self.rng.sample(block, width)
        if shuffled == block:
            shuffled = block[1:] + block[:1]
        new = order[:first] + shuffled + order[first + width :]
        return _Move("reorder", f"{width} chunks at slot {first} shuffled", lambda: self.window.reorder(new))

    def _recall(self) -> _Move:
        in_window = {ref.label for ref in self.window.refs}
        ref = self.rng.choice([r for r in self.window.evicted if r.label not in in_window])
        capacity = self.window.config.capacity_chunks
        full = capacity is not None and len(self.window) >= capacity  # the recall evicts one first
        at = self.rng.choice((None, self.rng.randint(0, len(self.window) - int(full))))
        where = "the end" if at is None else f"slot {at}"
        return _Move("recall", f"{ref.label} back at {where}", lambda: self.window.recall(ref, at=at))
