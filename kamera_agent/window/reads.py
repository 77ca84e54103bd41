"""What a window lets you read without changing it: its settings, chunks, states, costs and KV,
and the probes that decode with a chunk switched off.

Why apart from the ops: reading never plans or commits an edit (a probe's formed states are
stored, the window is left as it was), so the face's reads and its ops are two jobs; the window
(`KameraWindow`) is both, its ops in `kamera_agent.window.window`.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import torch

from kamera_agent.backends.base import Backend, DecodeConfig
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.config import WindowConfig
from kamera_agent.core import Patch
from kamera_agent.core.identity import ChunkState
from kamera_agent.divergence import next_token_kl
from kamera_agent.errors import UnknownChunkError
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.results import Answer, Plan, Probe, WindowStats
from kamera_agent.store import ChunkStore
from kamera_agent.window.arguments import check_choice, check_flag, check_int, check_text
from kamera_agent.window.conversation import Conversation
from kamera_agent.window.executor import Executor
from kamera_agent.window.inputs import Inputs
from kamera_agent.window.runner import OpRunner, WindowParts
from kamera_agent.window.state import ChunkRef

__all__ = ["WindowReads"]


class WindowReads:
    """The reads of a window (`KameraWindow` is one): each takes the window's lock or reads
    its shared parts, and none plans or commits an op."""

    _parts: WindowParts
    _runner: OpRunner
    _inputs: Inputs

    def __repr__(self) -> str:
        names = [ref.label or str(ref) for ref in self.refs]
        shown = ", ".join(names[:6]) + (f", … ({len(names) - 6} more)" if len(names) > 6 else "")
        kind = "conversation" if self.conversation is not None else "window"
        total = self.stats.total
        return (
            f"KameraWindow({kind}: {len(names)} chunks [{shown}], {len(self.evicted)} evicted, "
            f"{self._runner.end()} positions; rank={self.config.rank}; so far {total.forwards} forwards, "
            f"{total.tokens_prefilled:,} tokens prefilled, {total.tokens_reused:,} reused)"
        )

    @property
    def config(self) -> WindowConfig:
        """How the window behaves."""
        return self._parts.config

    @property
    def backend(self) -> Backend:
        """The engine the window runs on."""
        return self._parts.backend

    @property
    def encoder(self) -> ChunkEncoder:
        """What prepares this window's chunks (``window.encoder.image(..., kind="screenshot")``);
        a conversation window's carries its system prompt as its anchor."""
        return self._parts.encoder

    @property
    def conversation(self) -> Conversation | None:
        """The chat framing of a conversation window (``None`` for one user turn)."""
        return self._parts.conversation

    @property
    def store(self) -> ChunkStore:
        """The content-addressed store of canonicals, vision outputs and patches."""
        return self._parts.core.store

    @property
    def refs(self) -> list[ChunkRef]:
        """The chunks in the window, left to right."""
        with self._runner.lock:
            return list(self._runner.state.order)

    @property
    def evicted(self) -> list[ChunkRef]:
        """Chunks that left the window and can be recalled."""
        with self._runner.lock:
            return [ref for ref, entry in self._runner.state.entries.items() if not entry.in_window]

    def __len__(self) -> int:
        return len(self._runner.state.order)

    def chunk(self, ref: ChunkRef) -> Chunk:
        """The model-ready chunk behind a ref."""
        return self._inputs.entry(ref).chunk

    def patch_of(self, ref: ChunkRef) -> Patch | None:
        """The patch ``ref``'s KV carries now (``None``: the canonical alone)."""
        return self._inputs.entry(ref).patch

    def state_of(self, ref: ChunkRef) -> ChunkState:
        """What ``ref``'s KV encodes: its content, patch and the chained states of its antecedents."""
        return self._inputs.entry(ref).state

    def drift_of(self, ref: ChunkRef) -> float | None:
        """``ref``'s estimated drift: its relative KV error against a re-prefill of the window as
        it is, as the drift budget estimates it (`kamera_agent.fidelity`); 0 where the window
        holds it exactly, ``None`` where nothing estimates it (``drift_budget=None``)."""
        with self._runner.lock:
            entry = self._inputs.entry(ref)
            if not entry.in_window:
                raise UnknownChunkError(f"{ref} is not in the window (evicted): it has no drift there")
            return self._runner.drift()[self._runner.state.order.index(ref)]

    @property
    def budget(self) -> float | None:
        """The drift budget ε the window holds to (0: exact; ``None``: none, approximations unbounded)."""
        budget = self._parts.budget
        if budget is not None:
            return budget.epsilon
        return 0.0 if self.config.drift_budget == 0 else None

    @property
    def graph(self) -> nx.DiGraph:
        """The antecedent graph (edge A→B: B's KV encodes A), as a frozen copy.

        Nodes are every chunk the window knows, with ``in_window``, ``label`` and ``state`` (its
        `ChunkState`); each edge carries ``index`` (A's place among B's antecedents) and
        ``state`` (the digest of the state of A that B encodes).
        """
        with self._runner.lock:
            state = self._runner.state
            graph = state.graph.copy()
            for ref, entry in state.entries.items():
                graph.nodes[ref].update(in_window=entry.in_window, label=ref.label, state=entry.state)
                for source, index, digest in state.recorded(ref):
                    graph.pred[ref][source].update(index=index, state=digest)
        return nx.freeze(graph)

    @property
    def stats(self) -> WindowStats:
        """Per-op and cumulative costs."""
        with self._runner.lock:
            return self._runner.state.book.snapshot()

    @property
    def last_plan(self) -> Plan | None:
        """The edits the last op (or read: lazily deferred patches formed before an answer)
        executed, each naming its chunk's ref: what a caller accounts per chunk from."""
        return self._runner.last_plan

    def probe_without(self, ref: ChunkRef, query: str, *, max_new_tokens: int = 8) -> Probe:
        """Is ``ref`` still load-bearing for ``query``? Decode with its influence switched off.

        The chunk is left out and the chunks whose KV encodes it are served without that
        conditioning: a stored state for their reduced context (full KV, a patch) or their stored
        canonical; from the first the store cannot serve, the rest are formed over what is left
        in one forward (exact; stored, so the probe again or evicting ``ref`` reuses them). The
        window is unchanged afterwards. The answer with the chunk is the last greedy ``ask`` of
        the same query when nothing changed since (then the probe decodes once), else it is
        decoded too.
        """
        self._inputs.in_window(ref)
        check_text(query, "query")
        config = DecodeConfig(max_new_tokens=check_int(max_new_tokens, "max_new_tokens"))
        query_ids = self._parts.query_ids(query)
        self._parts.core.check_fits(self._runner.end(), query_ids, config)

        def both(executor: Executor) -> tuple[Answer, Answer]:
            with_chunk = self._runner.with_answer(executor, query, query_ids, config)
            return with_chunk, executor.answer_without(ref, query_ids, config)

        (with_chunk, without), cost = self._runner.read("probe", both)
        kl = next_token_kl(with_chunk.first_logits, without.first_logits)
        agree = int(with_chunk.first_logits.argmax()) == int(without.first_logits.argmax())
        return Probe(with_chunk, without, kl, agree, kl < self.config.probe_threshold, cost)

    def probe_kl(self, ref: ChunkRef, query: str) -> float:
        """Next-token KL of ``query`` with ``ref`` switched off: ``probe_without``'s score alone."""
        return self.probe_without(ref, query, max_new_tokens=1).kl

    def kv(self) -> Any:
        """The assembled cache of the window (anchor + placed chunks), as the backend holds it."""
        placed, _ = self._runner.read("kv", lambda executor: executor.placements())
        return self.backend.assemble(placed)

    def chunk_kv(self, ref: ChunkRef) -> ChunkKV:
        """``ref``'s KV at its place in the window, exactly what ``state_of(ref)`` says it encodes
        (a lazily deferred patch is not formed by this read: the chunk is then its canonical)."""
        self._inputs.in_window(ref)
        kv, _ = self._runner.read("kv", lambda executor: executor.placed_kv(ref), materialize=False)
        return kv

    def as_model_inputs(self, query: str | None = None, *, answer_start: str = "") -> dict[str, Any]:
        """Keyword arguments for the model's own forward over a full re-prefill of the window
        (input ids, pixel values, grids, token types): the ground truth for exactness checks
        (``answer_start``: as `ask` takes it)."""
        check_text(query, "query", optional=True)
        check_text(answer_start, "answer_start")
        with self._runner.lock:
            state = self._runner.state
            chunks = [state.entries[ref].chunk for ref in state.order]
        query_ids = None if query is None else self._parts.query_ids(query, answer_start=answer_start)
        return self.backend.reference_inputs(chunks, query_ids, anchor=self._parts.core.anchor)

    def query_ids(
        self, query: str, *, in_message: bool = False, query_role: str = "user", answer_start: str = ""
    ) -> torch.Tensor:
        """The token ids ``ask`` would decode ``query`` from (its framing and ``answer_start``
        included): a copy, the window remembers its own."""
        return self._parts.query_ids(
            check_text(query, "query"),
            opened=not check_flag(in_message, "in_message"),
            role=check_choice(query_role, "query_role", ("user", "tool")),
            answer_start=check_text(answer_start, "answer_start"),
        ).clone()
