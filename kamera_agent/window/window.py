"""KameraWindow: the deque of chunks an agent's model attends to, edited without re-prefill.

    window = KameraWindow(model, processor)
    frame = window.push(image)            # encode once (store hit: free), patch on its left context
    window.slide()                        # oldest leaves; survivors only rotate
    window.recall(frame)                  # back from the store: rotation + its stored patch
    answer = window.ask("What changed?")  # anchor + relocated, patched chunks -> decode

Every operation is planned first (`kamera_agent.window.planner`), then executed as cache edits;
its cost lands in ``window.stats``. A failed operation restores the window as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import torch
from PIL import Image

from kamera_agent.backends.base import Backend, DecodeConfig
from kamera_agent.chunks.chunk import Chunk, ChunkKind
from kamera_agent.chunks.sources import ChannelOrder, VideoFrame
from kamera_agent.config import WindowConfig
from kamera_agent.errors import (
    UnreadableInputError,
)
from kamera_agent.metrics import next_token_kl
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.operator.patch import Patch
from kamera_agent.results import Answer, OpCost, Plan, Probe, WindowStats
from kamera_agent.settings import THREADS_ENV, configure_threads
from kamera_agent.store import ChunkStore
from kamera_agent.window.costs import CostMeter, StatsBook
from kamera_agent.window.execution import ExecutionMixin
from kamera_agent.window.planner import WindowPlan
from kamera_agent.window.planning import PlanningMixin
from kamera_agent.window.state import ChunkRef, WindowState

__all__ = ["KameraWindow"]

Item = Chunk | str | Image.Image | np.ndarray | Path | VideoFrame


class KameraWindow(PlanningMixin, ExecutionMixin):
    """A window of chunks over one model, with position-free reuse of every chunk's KV.

    Args:
        model: a loaded transformers model, a local checkpoint path, or a `Backend`.
        processor: the model's processor, if it has a full one.
        tokenizer: the tokenizer, when no processor is given.
        image_processor: the image processor, when no processor is given (VLMs).
        config: how the window behaves (`WindowConfig`); default ``WindowConfig()``.
        store: a `ChunkStore` to share between windows of the same model.
    """

    def __init__(
        self,
        model: Any,
        processor: Any | None = None,
        *,
        tokenizer: Any | None = None,
        image_processor: Any | None = None,
        config: WindowConfig | None = None,
        store: ChunkStore | None = None,
    ) -> None:
        self.config = config or WindowConfig()
        if self.config.threads is not None or THREADS_ENV in os.environ:
            configure_threads(self.config.threads)  # the setting, else $KAMERA_NUM_THREADS
        self.backend = _resolve_backend(model, processor, tokenizer, image_processor, self.config, store)
        self._state = WindowState()
        self._book = StatsBook()
        self._placed: dict[ChunkRef, tuple[int, int, ChunkKV]] = {}

    # -- reading the window ----------------------------------------------------------------
    @property
    def refs(self) -> list[ChunkRef]:
        """The chunks in the window, left to right."""
        return list(self._state.order)

    @property
    def evicted(self) -> list[ChunkRef]:
        """Chunks that left the window and can be recalled."""
        return [ref for ref, entry in self._state.entries.items() if not entry.in_window]

    def __len__(self) -> int:
        return len(self._state.order)

    def chunk(self, ref: ChunkRef) -> Chunk:
        """The model-ready chunk behind a ref."""
        return self._entry(ref).chunk

    def patch_of(self, ref: ChunkRef) -> Patch | None:
        """The patch ``ref``'s KV carries now (``None``: the canonical alone)."""
        return self._entry(ref).patch

    @property
    def graph(self) -> nx.DiGraph:
        """The antecedent graph (edge A→B: B's KV encodes A), as a frozen copy.

        Nodes are every chunk ever admitted, with ``in_window`` and ``label`` attributes.
        """
        graph = self._state.graph.copy()
        for ref, entry in self._state.entries.items():
            graph.nodes[ref].update(in_window=entry.in_window, label=ref.label)
        return nx.freeze(graph)

    @property
    def stats(self) -> WindowStats:
        """Per-op and cumulative costs."""
        return self._book.snapshot()

    # -- operations -------------------------------------------------------------------------
    def push(
        self,
        item: Item,
        *,
        label: str | None = None,
        kind: ChunkKind | None = None,
        caption: str | None = None,
        channel_order: ChannelOrder | None = None,
    ) -> ChunkRef:
        """Admit an image, frame, screenshot, page, text or `Chunk` at the right end.

        A content-key hit reuses the stored canonical (no vision, no prefill) and any stored
        patch for the same antecedents. Over capacity, the eviction policy makes room first.

        Mutates: the window (admits one chunk, may evict), the store (canonical, patch).
        """
        chunk = self._chunk_of(item, kind, caption, channel_order, label)
        plan = self._plan_push(chunk, label)
        self._transact(plan)
        return plan.admitted[0]

    def reorder(self, refs: Sequence[ChunkRef]) -> None:
        """Put the window's chunks in a new order (a permutation of `refs`).

        Each chunk relocates by rotation; one whose antecedent sequence changed is served by
        its orbit patch (same set), a stored patch, or the reorder policy.

        Mutates: the window's order and patches; the store (patches formed).
        """
        self._transact(self._plan_reorder(refs))

    def slide(self, n: int = 1) -> list[ChunkRef]:
        """Evict the ``n`` leftmost chunks; returns them. Survivors only rotate (by default).

        Mutates: the window.
        """
        if n < 0:
            raise ValueError(f"slide needs n >= 0, got {n}")
        plan = self._plan_remove(self._state.order[:n], "slide")
        self._transact(plan)
        return list(plan.evicted)

    def evict(self, ref: ChunkRef) -> None:
        """Take one chunk out of the window (its canonical and patches stay: recallable).

        Mutates: the window.
        """
        self._in_window(ref)
        self._transact(self._plan_remove([ref], "evict"))

    def recall(self, ref: ChunkRef, at: int | None = None) -> ChunkRef:
        """Re-admit an evicted chunk at index ``at`` (default: the right end).

        No vision re-encode while its canonical is stored. Its patch comes from its original
        earlier context (default: stored at admission, so free) or the chunks now left of it;
        chunks after it are re-patched in order (``cascade``) or kept, as the plan says.

        Mutates: the window, the store (patches formed).
        """
        self._transact(self._plan_recall(ref, at))
        return ref

    def ask(
        self,
        query: str,
        *,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        return_logits: bool = False,
    ) -> Answer:
        """Answer ``query`` over the window: greedy by default, sampled with a temperature."""
        config = DecodeConfig(
            max_new_tokens or self.config.max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            tuple(stop),
            return_logits,
        )
        meter = CostMeter(self.backend.counters)
        answer = self._answer(query, config, meter)
        if temperature <= 0:
            self._state.last_answer = (query, self._state.tick, answer)
        cost = meter.finish()
        self._book.record("ask", cost)
        return _with_cost(answer, cost)

    def probe_without(self, ref: ChunkRef, query: str, *, max_new_tokens: int = 8) -> Probe:
        """Is ``ref`` still load-bearing for ``query``? Decode with its influence switched off.

        The chunk is left out and the chunks whose KV encodes it are served without that
        conditioning (a stored patch for their reduced context, else their canonical). No
        re-prefill, and the window is unchanged afterwards. The answer with the chunk is the
        last greedy ``ask`` of the same query when nothing changed since (then the probe is one
        decode), else it is decoded too.
        """
        self._in_window(ref)
        config = DecodeConfig(max_new_tokens=max_new_tokens)
        meter = CostMeter(self.backend.counters)
        self._materialize(meter)
        last = self._state.last_answer
        if last is not None and last[0] == query and last[1] == self._state.tick:
            with_chunk: Answer = last[2]
        else:
            with_chunk = self._answer(query, config, meter)
        order = [r for r in self._state.order if r != ref]
        placed = self._view_without(ref, order, meter)
        without = self._decode(placed, order, query, config)
        kl = next_token_kl(with_chunk.first_logits, without.first_logits)
        agree = int(with_chunk.first_logits.argmax()) == int(without.first_logits.argmax())
        cost = meter.finish()
        self._book.record("probe", cost)
        return Probe(with_chunk, without, kl, agree, kl < self.config.probe_threshold, cost)

    def probe_kl(self, ref: ChunkRef, query: str) -> float:
        """Next-token KL of ``query`` with ``ref`` switched off: ``probe_without``'s score alone."""
        return self.probe_without(ref, query, max_new_tokens=1).kl

    def fork(self) -> KameraWindow:
        """A copy-on-write branch: it shares canonicals and patches; edits stay in their branch."""
        branch = object.__new__(KameraWindow)
        branch.config = self.config
        branch.backend = self.backend
        branch._state = self._state.copy()
        branch._book = self._book.copy()
        branch._placed = dict(self._placed)
        return branch

    def plan(self, op: str, *args: Any, **kwargs: Any) -> Plan:
        """Dry run: the edits ``op`` ("push", "reorder", "slide", "evict", "recall") would do.

        Predicted forwards count a chunk encode only when its canonical is not stored.
        """
        builders: dict[str, Callable[..., WindowPlan]] = {
            "push": lambda item, label=None, **kw: self._plan_push(
                self._chunk_of(item, label=label, **kw), label
            ),
            "reorder": self._plan_reorder,
            "slide": lambda n=1: self._plan_remove(self._state.order[:n], "slide"),
            "evict": lambda ref: self._plan_remove([self._in_window(ref)], "evict"),
            "recall": self._plan_recall,
        }
        if op not in builders:
            raise ValueError(f"unknown op {op!r}; plan one of {', '.join(builders)}")
        plan = builders[op](*args, **kwargs)
        chunks = {**{r: e.chunk for r, e in self._state.entries.items()}, **plan.chunks}
        tokens = {ref: chunk.num_tokens for ref, chunk in chunks.items()}
        encodes = {ref: 0 if self.store.has_canonical(chunk.key) else 1 for ref, chunk in chunks.items()}
        return plan.public(encodes, tokens)

    def kv(self) -> Any:
        """The assembled cache of the window (anchor + placed chunks), as the backend holds it."""
        meter = CostMeter(self.backend.counters)
        self._materialize(meter)
        cache = self.backend.assemble(self._placements(meter))
        self._book.record("kv", meter.finish())
        return cache

    def as_model_inputs(self, query: str | None = None) -> dict[str, Any]:
        """Keyword arguments for the model's own forward over a full re-prefill of the window
        (input ids, pixel values, grids, token types): the ground truth for exactness checks."""
        chunks = [self._state.entries[ref].chunk for ref in self._state.order]
        query_ids = None if query is None else self._encoder.query_ids(query)
        return self.backend.reference_inputs(chunks, query_ids)

    def _chunk_of(
        self,
        item: Item,
        kind: ChunkKind | None = None,
        caption: str | None = None,
        channel_order: ChannelOrder | None = None,
        label: str | None = None,
    ) -> Chunk:
        encoder = self._encoder
        if isinstance(item, Chunk):
            return item
        if isinstance(item, str):
            return encoder.text(item, label=label)
        if isinstance(item, VideoFrame):
            meta = {"frame": str(item.index), "seconds": f"{item.seconds:.3f}"}
            return encoder.image(item.image, kind=kind or "frame", caption=caption, label=label, meta=meta)
        if isinstance(item, Image.Image | np.ndarray | Path):
            return encoder.image(
                item, kind=kind or "image", caption=caption, channel_order=channel_order, label=label
            )
        raise UnreadableInputError(
            f"cannot push a {type(item).__name__}; push a PIL image, an array (with channel_order), "
            "a Path to an image, a VideoFrame, text (str) or a Chunk"
        )


def _resolve_backend(
    model: Any,
    processor: Any | None,
    tokenizer: Any | None,
    image_processor: Any | None,
    config: WindowConfig,
    store: ChunkStore | None,
) -> Backend:
    from kamera_agent.loading import load_backend

    if isinstance(model, Backend):
        return model
    dtype = getattr(torch, config.dtype) if config.dtype is not None else None
    if not isinstance(model, str | Path):
        if config.device is not None:
            model = model.to(torch.device(config.device))
        if dtype is not None:
            model = model.to(dtype)
    backend = load_backend(
        model,
        processor,
        tokenizer=tokenizer,
        image_processor=image_processor,
        dtype=dtype,
        device=config.device,
        store=store,
    )
    if store is None and (
        config.disk_dir is not None or config.memory_budget != backend.store.stats().memory_budget
    ):
        backend.store = ChunkStore(
            fingerprint=backend.fingerprint,
            memory_budget=config.memory_budget,
            disk_dir=config.disk_dir,
            disk_budget=config.disk_budget,
        )
    return backend


def _with_cost(answer: Answer, cost: OpCost) -> Answer:
    from dataclasses import replace

    return replace(answer, cost=cost)
