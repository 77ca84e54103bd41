"""Window suite: a long scripted agent episode through KameraWindow, measured after every op.

Why an episode: what an agent pays is the sum over its window's life, and what it reads is the
window after each op, not only the last one. The episode pushes the demo task's frames into a
window of bounded capacity (the oldest leave when it is full), slides, reorders blocks of frames
and recalls evicted ones, deterministically from one seed: every setting sees the same ops.
After every op the followers (the prefix cache, `PrefixCache`, and any other system that follows
the window's lineup: `Follower`) are brought to the same sequence, in the same process, and each
side's cost is recorded: tokens prefilled, forwards, vision-tower runs and wall time, op by op.
Frames are rendered and preprocessed before any clock starts.

Then, outside every clock, each side is measured against the model's own re-prefill of the
window's current sequence plus the suite's question (``window.as_model_inputs``): the next-token
KL of the first answer token, whether its argmax agrees, the largest logit difference. kamera
answers with ``window.ask(query, decode=DecodeConfig(max_new_tokens=1))``, a follower with its
own forward over its cache. The episode is an agent that asks after every op; the question's own
cost is recorded apart (``ask_ms``, ``ask_forwards``) and never counted as the op's.

Lazy patches: a window with ``patch_mode="lazy"`` defers patches to its next read. So that the
question never pays for them, the op's clock also covers a read that forms them
(``window.kv()``, which also assembles the window once); what it spent is the op's. Every cost is
the change in ``window.stats.total`` across the clock, so nothing the window does there is lost.

The prefix cache keeps vision-tower outputs by content, as vLLM and SGLang do, so neither side
re-runs the vision tower for pixels it has seen; what differs is the language model's work.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import torch
from rich.progress import Progress

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.baselines.prefix_cache import PrefixCache, Sync
from kamera_agent.bench.blend_cache import BlendCache
from kamera_agent.bench.common import finite, wall
from kamera_agent.bench.corpus import Half, passages, question
from kamera_agent.bench.floor import FLOORS, Floor
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.compat import last_logits_only
from kamera_agent.config import WindowConfig
from kamera_agent.demo.task import QUESTIONS, Page, make_items, render_legend, render_page
from kamera_agent.results import OpCost
from kamera_agent.window import KameraWindow

__all__ = [
    "FOLLOWERS",
    "KAMERA",
    "PREFIX",
    "QUERY",
    "RECOMPUTE",
    "RECOMPUTE_PERCENTS",
    "Follower",
    "OpRecord",
    "Spent",
    "WindowRun",
    "run_window",
    "text_frames",
]

_WEIGHTS = {"push": 0.35, "slide": 0.15, "reorder": 0.25, "recall": 0.25}
QUERY = QUESTIONS["colour"]
"""The question every side answers after every op (its first token is what is compared)."""
KAMERA = "kamera"
PREFIX = "prefix cache"


class Follower(Protocol):
    """A system that follows the window's lineup op by op (the prefix cache; any other that
    reuses KV by its own rule). It is timed in `sync` only; `first_logits` is the measurement."""

    def sync(self, chunks: Sequence[Chunk]) -> Sync:
        """Hold ``anchor + chunks``; what that cost."""
        ...

    def first_logits(self, query_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits of ``query_ids`` placed after what it holds (one forward)."""
        ...


RECOMPUTE_PERCENTS = tuple(range(5, 65, 5))
"""The token-recompute sweep: 5 to 60 % of every placed chunk's tokens, in 5 % steps."""
RECOMPUTE = tuple(f"recompute {percent}%" for percent in RECOMPUTE_PERCENTS)
"""The sweep's follower names (`BlendCache`), in order."""

FOLLOWERS: Mapping[str, Callable[[TransformersBackend], Follower]] = MappingProxyType(
    {
        PREFIX: PrefixCache,
        **{
            name: partial(BlendCache, fraction=percent / 100)
            for name, percent in zip(RECOMPUTE, RECOMPUTE_PERCENTS, strict=True)
        },
        **{name: partial(Floor, dtype=dtype) for name, dtype in FLOORS.items()},
    }
)
"""Every follower a run can host, by name. A run's `WindowRun.followers` names those it runs;
each becomes a row of the frontier, its wall time set against the prefix cache of the same run."""


@dataclass(frozen=True)
class Spent:
    """What one side paid for one op, and how its answer compared with re-prefill after it.

    Attributes:
        tokens: tokens prefilled (kamera: the op's, and the patches a lazy window deferred,
            formed inside its clock; a follower: its sync).
        forwards: language-model forwards.
        vision: vision-tower runs.
        ms: wall milliseconds of the op (a follower: its sync).
        ask_ms: wall milliseconds of the measurement's question (kamera: placing what changed
            and the query's forward; a follower: the query's forward); never part of ``ms``.
        ask_forwards: forwards the question ran (1: nothing deferred was left for it to form).
        kl: next-token KL(re-prefill ‖ side) of the first answer token.
        agrees: the side's first answer token (argmax) is re-prefill's.
        logit_error: max |logit difference| to re-prefill.
    """

    tokens: int
    forwards: int
    vision: int
    ms: float
    ask_ms: float
    ask_forwards: int
    kl: float
    agrees: bool
    logit_error: float


@dataclass(frozen=True)
class OpRecord:
    """One op of the episode, and each side's cost and answer after it (by side name)."""

    op: str
    detail: str
    chunks: int
    window_tokens: int
    sides: Mapping[str, Spent]


@dataclass
class WindowRun:
    """One run of the episode: a window under one setting and the followers beside it.

    Attributes:
        row: the frontier row the window is (``"defaults"``, ``"exact"``, ``"rank-4"`` ...).
        config: the window's settings (`WindowConfig`, dumped).
        changed: the settings that differ from the defaults, in words (``"rank=4"``).
        followers: the followers run beside the window, by `FOLLOWERS` name.
        records: one per finished op.
        seconds: wall time of the whole run, measurements included.
    """

    row: str
    seed: int
    ops_requested: int
    capacity: int
    config: dict[str, Any] = field(default_factory=dict)
    changed: str = ""
    followers: tuple[str, ...] = (PREFIX,)
    records: list[OpRecord] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def sides(self) -> tuple[str, ...]:
        return (KAMERA, *self.followers)

    def total(self, side: str, name: str) -> float:
        """A side's sum of one `Spent` field over the ops done."""
        return float(sum(getattr(record.sides[side], name) for record in self.records))

    def values(self, side: str, name: str) -> list[float]:
        return [float(getattr(record.sides[side], name)) for record in self.records]

    def cumulative(self, side: str, name: str) -> list[float]:
        running, out = 0.0, []
        for value in self.values(side, name):
            running += value
            out.append(running)
        return out

    def to_json(self) -> dict[str, Any]:
        names = ("tokens", "forwards", "vision", "ms", "ask_ms")
        return {
            "row": self.row,
            "seed": self.seed,
            "ops_requested": self.ops_requested,
            "ops_done": len(self.records),
            "capacity_chunks": self.capacity,
            "config": self.config,
            "changed": self.changed,
            "followers": list(self.followers),
            "seconds": self.seconds,
            "ops": {op: sum(r.op == op for r in self.records) for op in _WEIGHTS},
            "totals": {side: {name: self.total(side, name) for name in names} for side in self.sides},
            "records": [
                {
                    "op": r.op,
                    "detail": r.detail,
                    "chunks": r.chunks,
                    "window_tokens": r.window_tokens,
                    "sides": {
                        side: {
                            **asdict(spent),
                            "kl": finite(spent.kl),
                            "logit_error": finite(spent.logit_error),
                        }
                        for side, spent in r.sides.items()
                    },
                }
                for r in self.records
            ],
        }


def run_window(
    model: Any,
    tokenizer: Any,
    image_processor: Any,
    run: WindowRun,
    config: WindowConfig,
    progress: Progress,
) -> None:
    """Run the episode on a fresh window under ``config`` (its own store: nothing carried over
    from other runs), the followers of ``run`` beside it, measuring every side after every op.

    Mutates: ``run`` (a record per op, its config and seconds; its followers, less the token
    recompute sweep where the model cannot recompute selected tokens).
    """
    began = time.perf_counter()
    run.config = config.model_dump(mode="json")
    window = KameraWindow(model, tokenizer=tokenizer, image_processor=image_processor, config=config)
    backend = window.backend
    assert isinstance(backend, TransformersBackend)
    if not backend.supports_recompute:  # token recompute cannot mask this model (sliding windows)
        run.followers = tuple(name for name in run.followers if name not in RECOMPUTE)
    followers = {name: FOLLOWERS[name](backend) for name in run.followers}
    episode = _Episode(window, backend.encoder, random.Random(run.seed), _items(run.ops_requested))
    query, start = QUERY, ""
    if backend.encoder.image_processor is None:  # a text model: passages of real text for frames
        episode.frames, (query, start) = text_frames(backend, run.seed, len(episode.frames)), question()
    query_ids = window.query_ids(query, answer_start=start)
    lazy = config.patch_mode == "lazy"
    task = progress.add_task(f"window · {run.row} · {run.ops_requested} ops", total=run.ops_requested)
    for _ in range(run.ops_requested):
        move = episode.next()
        before = window.stats.total
        started = wall()
        move.run()
        if lazy:
            window.kv()  # forms the patches the op deferred (see the module's docstring)
        kamera_ms, kamera = (wall() - started) * 1e3, _spent(window.stats.total, before)
        chunks = [window.chunk(ref) for ref in window.refs]
        synced = {name: follower.sync(chunks) for name, follower in followers.items()}
        reference = _reference(backend, window, query, start)
        sides = {KAMERA: _kamera_answer(window, kamera, kamera_ms, reference, (query, start))}
        for name, follower in followers.items():
            sides[name] = _follower_answer(follower, synced[name], query_ids, reference)
        run.records.append(
            OpRecord(move.op, move.detail, len(chunks), sum(c.num_tokens for c in chunks), sides)
        )
        progress.advance(task)
    run.seconds = time.perf_counter() - began


def _spent(after: OpCost, before: OpCost) -> OpCost:
    return OpCost(
        forwards=after.forwards - before.forwards,
        tokens_prefilled=after.tokens_prefilled - before.tokens_prefilled,
        vision_encodes=after.vision_encodes - before.vision_encodes,
    )


def _reference(backend: TransformersBackend, window: KameraWindow, query: str, start: str) -> torch.Tensor:
    """The model's own forward over the window's sequence and the question (``start``: the
    answer's opening): its next-token logits."""
    with torch.no_grad():
        inputs = window.as_model_inputs(query, answer_start=start)
        logits: torch.Tensor = backend.model(**inputs, **last_logits_only(backend.model)).logits
    return logits[0, -1].float().cpu()


def _compare(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, bool, float]:
    """KL, top-1 agreement and largest logit difference; a side whose logits are not finite (a
    model overflowing in fp16) agrees on nothing and is infinitely far, never "KL 0"."""
    logits = logits.float().cpu()
    if not bool(torch.isfinite(logits).all()):
        return math.inf, False, math.inf
    p, q = torch.log_softmax(reference.double(), -1), torch.log_softmax(logits.double(), -1)
    kl = max(0.0, float((p.exp() * (p - q)).sum()))
    agrees = int(reference.argmax()) == int(logits.argmax())
    return kl, agrees, float((logits - reference).abs().max())


def _kamera_answer(
    window: KameraWindow, op: OpCost, ms: float, reference: torch.Tensor, asked: tuple[str, str]
) -> Spent:
    before = window.stats.total
    started = wall()
    query, start = asked
    logits = window.ask(query, decode=DecodeConfig(max_new_tokens=1), answer_start=start).first_logits
    ask_ms, spent = (wall() - started) * 1e3, _spent(window.stats.total, before)
    kl, agrees, error = _compare(reference, logits)
    return Spent(
        op.tokens_prefilled, op.forwards, op.vision_encodes, ms, ask_ms, spent.forwards, kl, agrees, error
    )


def _follower_answer(
    follower: Follower, synced: Sync, query_ids: torch.Tensor, reference: torch.Tensor
) -> Spent:
    started = wall()
    logits = follower.first_logits(query_ids)
    ask_ms = (wall() - started) * 1e3
    kl, agrees, error = _compare(reference, logits)
    return Spent(
        synced.tokens, synced.forwards, synced.vision_runs, synced.seconds * 1e3, ask_ms, 1, kl, agrees, error
    )


def text_frames(
    backend: TransformersBackend, seed: int, count: int, half: Half = "benchmark", files: Sequence[Path] = ()
) -> list[tuple[str, Callable[[], Chunk]]]:
    """``count`` passages of real text for a model that reads no images: ``half`` of the shipped
    corpus (`kamera_agent.bench.corpus`), or the passages of ``files``."""
    texts = passages(half, seed, count, files)
    return [(f"passage {k}", partial(backend.encoder.text, text)) for k, text in enumerate(texts)]


def _items(ops: int) -> int:
    """Demo items the episode draws its frames from (6 frames each): 40 up to 400 ops, then one
    per 10 ops, so that pushes (about 45 % of the ops) keep bringing frames the window never held."""
    return max(40, -(-ops // 10))


@dataclass(frozen=True)
class _Move:
    """The next op, fully prepared (frames rendered and preprocessed): ``run`` is what is timed."""

    op: str
    detail: str
    run: Callable[[], object]


class _Episode:
    """Draws the next op from the window's state (deterministic given the seed)."""

    def __init__(self, window: KameraWindow, encoder: ChunkEncoder, rng: random.Random, items: int) -> None:
        self.window, self.encoder, self.rng = window, encoder, rng
        frames: list[tuple[str, Callable[[], Chunk]]] = []
        for n, item in enumerate(make_items(items, seed=rng.randrange(1 << 30))):
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
