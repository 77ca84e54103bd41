"""The sides an agent script runs on: kamera windows, the prefix cache and token recompute (on a
real text model), each timed per step.

Why each side owns its handles: a script names chunks by label; a `KameraWindow` hands out
its own refs, the prefix cache only needs the step's lineup. Each side runs one step (its ops,
then the question) and reports what it spent; the loop in `kamera_agent.bench.agents.run`
alternates the sides' order from step to step so that none always runs first.

The prefix cache is brought to the window's sequence once per step, when the agent would send
its next request: a prefix cache computes only when asked to (an engine prefills a request,
not each edit an agent makes to its prompt), so it pays for a step's net change, never for
each of its ops. Its question is tokenized inside its clock, as ``KameraWindow.ask`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.baselines.prefix_cache import PrefixCache
from kamera_agent.bench.agents.script import Evict, Extend, Op, Push, Question, Reorder, Replace, Step
from kamera_agent.bench.blend_cache import BlendCache
from kamera_agent.bench.common import wall
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.config import WindowConfig
from kamera_agent.window import KameraWindow
from kamera_agent.window.state import ChunkRef

__all__ = ["KameraSide", "OpSpent", "Outcome", "PrefixSide", "RecomputeSide", "SideCost", "answer_logits"]


@dataclass(frozen=True)
class OpSpent:
    """One op of a step (a window op, or ``"sync"`` / ``"ask"``) and what it spent.

    Attributes:
        op: ``push``, ``evict``, ``reorder``, ``recall``, ``arrange`` (a step of several ops),
            ``ask`` (kamera); ``sync``, ``ask`` (prefix).
        ms: wall milliseconds.
        tokens: tokens prefilled.
        forwards: language-model forwards.
        vision: vision-tower runs.
    """

    op: str
    ms: float
    tokens: int
    forwards: int
    vision: int = 0


@dataclass(frozen=True)
class SideCost:
    """What one side spent on one step (its ops and its question together)."""

    ms: float
    tokens: int
    forwards: int
    vision: int
    ask_ms: float = 0.0
    """The part of ``ms`` spent answering the question (0 without one)."""

    @classmethod
    def of(cls, ops: tuple[OpSpent, ...]) -> SideCost:
        return cls(
            sum(o.ms for o in ops),
            sum(o.tokens for o in ops),
            sum(o.forwards for o in ops),
            sum(o.vision for o in ops),
            sum(o.ms for o in ops if o.op == "ask"),
        )


@dataclass(frozen=True)
class Outcome:
    """A side's step: its cost, op by op, and the answer's next-token logits (if it asked)."""

    ops: tuple[OpSpent, ...]
    logits: torch.Tensor | None

    @property
    def cost(self) -> SideCost:
        return SideCost.of(self.ops)


class KameraSide:
    """A `KameraWindow` with a store of its own, over a shared backend, driven by labels."""

    def __init__(
        self, backend: TransformersBackend, config: WindowConfig, chunks: Mapping[str, Chunk]
    ) -> None:
        self.window = KameraWindow(backend, config=config)
        self.chunks = chunks
        self.refs: dict[str, ChunkRef] = {}

    def run(self, step: Step) -> Outcome:
        """Run the step's ops, then its question, each timed on its own; costs from the window.

        A step of several ops is one request, as an agent sends it and as `kamera serve` runs
        it: one `KameraWindow.arrange` to the step's lineup (recorded as ``arrange``), so its
        forwards are shared as the prefix cache's one sync shares them."""
        spent, logits = [], None
        for name, apply in self._requests(step):
            began = wall()
            apply()
            seconds, cost = wall() - began, self.window.stats.last
            spent.append(
                OpSpent(name, seconds * 1e3, cost.tokens_prefilled, cost.forwards, cost.vision_encodes)
            )
        if step.ask is not None:
            began = wall()
            logits = answer_logits(self.window, step.ask)
            seconds, cost = wall() - began, self.window.stats.last
            spent.append(
                OpSpent("ask", seconds * 1e3, cost.tokens_prefilled, cost.forwards, cost.vision_encodes)
            )
        return Outcome(tuple(spent), logits)

    def measure(self, query: Question) -> torch.Tensor:
        """First-token logits of ``query`` over the window as the step left it, untimed, from a
        fork: the window's own retained cache and costs stay as the script left them."""
        return answer_logits(self.window.fork(), query)

    def _apply(self, op: Op) -> None:
        window = self.window
        if isinstance(op, Push):
            self.refs[op.label] = window.push(self.chunks[op.label], label=op.label)
        elif isinstance(op, Extend):
            refs = window.extend([self.chunks[label] for label in op.labels], labels=list(op.labels))
            self.refs.update(zip(op.labels, refs, strict=True))
        elif isinstance(op, Replace):
            extra = [self.chunks[label] for label in op.append]
            old, chunk = self.refs[op.old], self.chunks[op.label]
            self.refs[op.label] = window.replace(
                old, chunk, label=op.label, append=extra, append_labels=op.append
            )
            if op.append:
                self.refs.update(zip(op.append, window.refs[-len(op.append) :], strict=True))
        elif isinstance(op, Evict):
            window.evict(self.refs[op.label])
        elif isinstance(op, Reorder):
            window.reorder([self.refs[label] for label in op.order])
        else:
            window.recall(self.refs[op.label], at=op.at)

    def _requests(self, step: Step) -> list[tuple[str, Callable[[], None]]]:
        """The step's ops as the window runs them: each on its own, or several as one arrange."""
        names = [type(op).__name__.lower() for op in step.ops]
        if len(names) > 1:
            return [("arrange", partial(self._arrange, step.lineup))]
        return [(name, partial(self._apply, op)) for name, op in zip(names, step.ops, strict=True)]

    def _arrange(self, lineup: Sequence[str]) -> None:
        """Make the window hold ``lineup`` in one op: a label seen before by its ref (moved,
        kept or recalled), a new one by its chunk."""
        items = [self.refs.get(label, self.chunks[label]) for label in lineup]
        refs = self.window.arrange(items, labels=[None if label in self.refs else label for label in lineup])
        self.refs.update(zip(lineup, refs, strict=True))

    def lineup(self) -> tuple[str, ...]:
        """The labels in the window, left to right (checked against the script after each step)."""
        return tuple(str(ref.label) for ref in self.window.refs)


def answer_logits(window: KameraWindow, question: Question) -> torch.Tensor:
    """The first answer token's logits of ``question`` over ``window`` (one token decoded)."""
    decode = DecodeConfig(max_new_tokens=1)
    return window.ask(question.text, answer_start=question.answer_start, decode=decode).first_logits


class PrefixSide:
    """The prefix cache (`PrefixCache`, vision outputs cached by content) over a shared backend."""

    def __init__(self, backend: TransformersBackend, chunks: Mapping[str, Chunk]) -> None:
        self.cache = PrefixCache(backend)
        self.chunks = chunks

    def run(self, step: Step) -> Outcome:
        """Sync to the step's lineup (one forward over everything from the first change), then
        prefill the question over it."""
        sequence = [self.chunks[label] for label in step.lineup]
        synced = self.cache.sync(sequence)
        spent = [OpSpent("sync", synced.seconds * 1e3, synced.tokens, synced.forwards, synced.vision_runs)]
        logits = None
        if step.ask is not None:
            began = wall()
            answered = self.cache.ask(step.ask.ids(self.cache.backend.encoder))
            seconds = wall() - began
            spent.append(OpSpent("ask", seconds * 1e3, answered.tokens, answered.forwards))
            logits = answered.logits
        return Outcome(tuple(spent), logits)

    def measure(self, query: Question, lineup: Sequence[str]) -> torch.Tensor:
        """First-token logits of ``query`` over the step's lineup, untimed; the query is cropped
        off again, so the next step's sync starts from the lineup alone, as after a question."""
        logits = self.cache.ask(query.ids(self.cache.backend.encoder)).logits
        self.cache.sync([self.chunks[label] for label in lineup])
        return logits


class RecomputeSide:
    """Token recompute (`BlendCache`) over a shared backend: at every step each chunk's canonical
    KV is placed in the lineup behind the unchanged prefix, a share of its tokens recomputed."""

    def __init__(self, backend: TransformersBackend, chunks: Mapping[str, Chunk], fraction: float) -> None:
        self.cache = BlendCache(backend, fraction)
        self.chunks = chunks

    def run(self, step: Step) -> Outcome:
        """Sync to the step's lineup, then prefill the question over what it holds."""
        synced = self.cache.sync([self.chunks[label] for label in step.lineup])
        spent = [OpSpent("sync", synced.seconds * 1e3, synced.tokens, synced.forwards, synced.vision_runs)]
        logits = None
        if step.ask is not None:
            began = wall()
            ids = step.ask.ids(self.cache.backend.encoder)
            logits = self.cache.first_logits(ids)
            spent.append(OpSpent("ask", (wall() - began) * 1e3, int(ids.shape[0]), 1))
        return Outcome(tuple(spent), logits)

    def measure(self, query: Question, lineup: Sequence[str]) -> torch.Tensor:
        """First-token logits of ``query`` over what the step left, untimed (nothing it holds changes)."""
        return self.cache.first_logits(query.ids(self.cache.backend.encoder))
