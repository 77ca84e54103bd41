"""An agent as data: a deterministic script of window operations, built before any clock starts.

Why data rather than code: the same script must drive several sides (kamera under two settings,
a prefix cache) identically and be checked against what each window holds after every step.
A script names chunks by label; each side maps labels to its own handles. Every chunk is
prepared (tokenized, preprocessed) when the script is built, so the timed loop only runs ops.

A `Step` is one decision of the agent loop: the window ops it makes (pushes, extensions,
replacements, evictions, reorders, recalls), optionally followed by a question, and the lineup
(labels, left to right) the window must hold afterwards. The builder keeps that lineup the way
a window with FIFO eviction does, so a script that disagrees with a window fails loudly
instead of timing something else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder

__all__ = [
    "Evict",
    "Extend",
    "Op",
    "Push",
    "Question",
    "Recall",
    "Reorder",
    "Replace",
    "Script",
    "ScriptBuilder",
    "Step",
]


@dataclass(frozen=True)
class Question:
    """What the agent asks after a step, and the opening of the answer the model continues
    (`KameraWindow.ask`'s ``answer_start``): its first token is what every side is checked on,
    so an opening makes that token name what was read rather than open any answer ("The")."""

    text: str
    answer_start: str = ""

    def ids(self, encoder: ChunkEncoder) -> torch.Tensor:
        return encoder.query_ids(self.text, self.answer_start)


@dataclass(frozen=True)
class Push:
    """Admit the chunk ``label`` at the right end (a full window first evicts its leftmost)."""

    label: str


@dataclass(frozen=True)
class Extend:
    """Admit the chunks ``labels`` at the right end, in order, as one op (`KameraWindow.extend`)."""

    labels: tuple[str, ...]


@dataclass(frozen=True)
class Replace:
    """Put the chunk ``label`` in ``old``'s slot and evict ``old``, admitting the chunks
    ``append`` at the right end in the same op (`KameraWindow.replace`)."""

    old: str
    label: str
    append: tuple[str, ...] = ()


@dataclass(frozen=True)
class Evict:
    """Take ``label`` out of the window (recallable)."""

    label: str


@dataclass(frozen=True)
class Reorder:
    """Put the window's chunks in this order (labels, left to right)."""

    order: tuple[str, ...]


@dataclass(frozen=True)
class Recall:
    """Bring the evicted ``label`` back at index ``at`` (``None``: the right end)."""

    label: str
    at: int | None = None


Op = Push | Extend | Replace | Evict | Reorder | Recall


@dataclass(frozen=True)
class Step:
    """One decision of the agent: its ops, an optional question, the lineup it leaves.

    Attributes:
        kind: what the agent did, in a word ("push", "frame", "replace", "read", "go back").
        detail: which chunks, in words.
        ops: the window ops, in order.
        ask: the question asked after the ops, if any.
        lineup: the labels in the window after the ops, left to right.
    """

    kind: str
    detail: str
    ops: tuple[Op, ...]
    ask: Question | None
    lineup: tuple[str, ...]


@dataclass(frozen=True)
class Script:
    """A whole agent run: its chunks (prepared), its steps and what sizes it uses.

    Attributes:
        agent: the agent's name.
        summary: what it does, in one line.
        capacity: the window's chunk capacity (``None``: unbounded).
        chunks: every chunk the script pushes, by label.
        steps: the steps, in order.
        kinds: label -> the content kind it is ("frame", "screenshot", "caption" ...).
    """

    agent: str
    summary: str
    capacity: int | None
    chunks: Mapping[str, Chunk]
    steps: tuple[Step, ...]
    kinds: Mapping[str, str]

    @property
    def sizes(self) -> dict[str, str]:
        """Tokens per chunk of each content kind ("40", or "14-18" where they vary)."""
        seen: dict[str, set[int]] = {}
        for label, chunk in self.chunks.items():
            seen.setdefault(self.kinds[label], set()).add(chunk.num_tokens)
        return {
            kind: str(min(n)) if len(n) == 1 else f"{min(n)}-{max(n)}" for kind, n in sorted(seen.items())
        }

    @property
    def asks(self) -> int:
        return sum(step.ask is not None for step in self.steps)


@dataclass
class ScriptBuilder:
    """Builds a `Script` op by op, keeping the lineup a FIFO window of ``capacity`` would hold.

    Raises (from its methods):
        ValueError: an op the window would refuse or resolve differently (a label pushed twice,
            an evict or reorder of what is not in the window, a recall into a full window).
    """

    agent: str
    summary: str
    capacity: int | None = None
    lineup: list[str] = field(default_factory=list)
    chunks: dict[str, Chunk] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    _ops: list[Op] = field(default_factory=list)
    _steps: list[Step] = field(default_factory=list)

    def push(self, label: str, chunk: Chunk, kind: str) -> None:
        if label in self.chunks:
            raise ValueError(f"{label!r} is pushed twice; labels name one chunk each")
        if self.capacity is not None and len(self.lineup) >= self.capacity:
            self.lineup.pop(0)  # the window's FIFO eviction makes room
        self.chunks[label], self.kinds[label] = chunk, kind
        self.lineup.append(label)
        self._ops.append(Push(label))

    def extend(self, items: list[tuple[str, Chunk, str]]) -> None:
        """Several new chunks (label, chunk, kind) at the right end as one op."""
        for label, chunk, kind in items:
            self.push(label, chunk, kind)
        del self._ops[-len(items) :]
        self._ops.append(Extend(tuple(label for label, _, _ in items)))

    def replace(
        self,
        old: str,
        label: str,
        chunk: Chunk,
        kind: str,
        append: Sequence[tuple[str, Chunk, str]] = (),
    ) -> None:
        """``label`` in ``old``'s slot; ``append`` (label, chunk, kind) at the right end, one op."""
        if label in self.chunks:
            raise ValueError(f"{label!r} is pushed twice; labels name one chunk each")
        slot = self.lineup.index(old)  # ValueError when it is not in the window
        self.chunks[label], self.kinds[label] = chunk, kind
        self.lineup[slot] = label
        for name, extra, extra_kind in append:
            self.push(name, extra, extra_kind)
        if append:
            del self._ops[-len(append) :]
        self._ops.append(Replace(old, label, tuple(name for name, _, _ in append)))

    def evict(self, label: str) -> None:
        self.lineup.remove(label)  # ValueError when it is not in the window
        self._ops.append(Evict(label))

    def reorder(self, order: list[str]) -> None:
        if sorted(order) != sorted(self.lineup):
            raise ValueError("a reorder must be a permutation of the window")
        self.lineup[:] = order
        self._ops.append(Reorder(tuple(order)))

    def recall(self, label: str, at: int | None) -> None:
        if label not in self.chunks or label in self.lineup:
            raise ValueError(f"{label!r} is not an evicted chunk")
        if self.capacity is not None and len(self.lineup) >= self.capacity:
            raise ValueError("recall into a full window: evict first (the window would pick for you)")
        self.lineup.insert(len(self.lineup) if at is None else at, label)
        self._ops.append(Recall(label, at))

    def step(self, kind: str, detail: str, ask: Question | None = None) -> None:
        """Close the current step: its ops so far, then ``ask``."""
        self._steps.append(Step(kind, detail, tuple(self._ops), ask, tuple(self.lineup)))
        self._ops = []

    def build(self) -> Script:
        if self._ops:
            raise ValueError("ops after the last step: close it with step()")
        return Script(
            self.agent, self.summary, self.capacity, dict(self.chunks), tuple(self._steps), dict(self.kinds)
        )
