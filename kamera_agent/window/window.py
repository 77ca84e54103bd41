"""KameraWindow: the deque of chunks an agent's model attends to, edited without re-prefill.

    window = KameraWindow(model, processor)
    frame = window.push(image)            # formed once (store hit: free), patched on its left context
    window.slide()                        # oldest leaves; survivors only rotate
    window.recall(frame)                  # back from the store: rotation + its stored patch
    answer = window.ask("What changed?")  # anchor + relocated, patched chunks -> decode

The window composes four parts: one `WindowState` (what ``fork`` copies and a failed op
restores), a pure `Planner` (state + a read-only store view -> plan), an `Executor` that
applies a plan inside one store transaction, and the engine-neutral `KVCore` over the backend
and the store. Every operation's cost lands in ``window.stats``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import networkx as nx
import torch

from kamera_agent.backends.base import Backend, DecodeConfig
from kamera_agent.chunks.chat import ChatTemplate
from kamera_agent.chunks.chunk import Chunk, ChunkKind
from kamera_agent.chunks.sources import ChannelOrder
from kamera_agent.config import WindowConfig
from kamera_agent.core import Patch
from kamera_agent.core.costs import CostMeter
from kamera_agent.core.identity import ChunkState
from kamera_agent.core.kv_core import KVCore, Txn
from kamera_agent.core.staging import StagedStore, StoreView
from kamera_agent.errors import (
    ChunkInWindowError,
    ContextOverflowError,
    DuplicateChunkError,
    LargeChunkWarning,
    SettingsError,
    UnknownChunkError,
    WindowError,
)
from kamera_agent.metrics import next_token_kl
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.results import Answer, OpCost, Plan, Probe, WindowStats
from kamera_agent.settings import THREADS_ENV, configure_threads
from kamera_agent.store import ChunkStore
from kamera_agent.window.conversation import Conversation, MessagePart
from kamera_agent.window.executor import Executor, StaleLookup
from kamera_agent.window.memory import release_evicted
from kamera_agent.window.plan import WindowPlan
from kamera_agent.window.planner import PlanInputs, Planner
from kamera_agent.window.setup import Item, chunk_of, resolve_backend, resolve_store
from kamera_agent.window.state import ChunkRef, Entry, LastAnswer, Scores, WindowState

__all__ = ["KameraWindow"]

T = TypeVar("T")
_ATTEMPTS = 3  # plans re-made when another window changed an orbit patch under an op


class KameraWindow:
    """A window of chunks over one model, with position-free reuse of every chunk's KV.

    Args:
        model: a loaded transformers model, a local checkpoint path, or a `Backend`.
        processor: the model's processor, if it has a full one.
        tokenizer: the tokenizer, when no processor is given.
        image_processor: the image processor, when no processor is given (VLMs).
        config: how the window behaves (`WindowConfig`); default ``WindowConfig()``.
        store: a `ChunkStore` to share between windows of the same model (default: one built
            from the config's ``memory_budget``, ``disk_dir``, ``disk_budget`` and ``store_url``).
        conversation: hold a chat (`push_message`; questions are framed as user messages) rather
            than one user turn; implied by ``system_prompt``.
        system_prompt: the conversation's system prompt (it is the window's anchor: fixed,
            never moved); ``None`` with ``conversation=True``: the chat template's default.

    Raises:
        SettingsError: a setting that cannot apply (``device``/``dtype`` for a `Backend` built
            elsewhere, store settings together with ``store=``).
        UnsupportedModelError: a conversation on a model whose chat template cannot frame
            messages as movable chunks (`ChatTemplate`).
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
        conversation: bool = False,
        system_prompt: str | None = None,
    ) -> None:
        self.config = config or WindowConfig()
        if self.config.threads is not None or THREADS_ENV in os.environ:
            configure_threads(self.config.threads)  # the setting, else $KAMERA_NUM_THREADS
        self.backend: Backend = resolve_backend(model, processor, tokenizer, image_processor, self.config)
        self.conversation: Conversation | None = None
        if conversation or system_prompt is not None:
            template = ChatTemplate.from_tokenizer(
                self.backend.encoder.tokenizer, self.backend.encoder.prompt
            )
            self.backend = self.backend.with_prompt(template.prompt_format(system_prompt))
            self.conversation = Conversation(template, self.backend.encoder, self.config.max_image_pixels)
        self._core = KVCore(self.backend, resolve_store(self.backend, self.config, store))
        self._state = WindowState()

    def close(self) -> None:
        """Close the window's store (`ChunkStore.close`: its memory entries written to its disk
        tier, the directory released, shared writes finished). Closing a store passed in with
        ``store=`` is its owner's call: this closes it too."""
        self._core.store.close()

    def __repr__(self) -> str:
        names = [ref.label or str(ref) for ref in self._state.order]
        shown = ", ".join(names[:6]) + (f", … ({len(names) - 6} more)" if len(names) > 6 else "")
        kind = "conversation" if self.conversation is not None else "window"
        total = self.stats.total
        return (
            f"KameraWindow({kind}: {len(names)} chunks [{shown}], {len(self.evicted)} evicted, "
            f"{self._end()} positions; rank={self.config.rank}; so far {total.forwards} forwards, "
            f"{total.tokens_prefilled:,} tokens prefilled, {total.tokens_reused:,} reused)"
        )

    def __enter__(self) -> KameraWindow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading the window ----------------------------------------------------------------
    @property
    def store(self) -> ChunkStore:
        """The content-addressed store of canonicals, vision outputs and patches."""
        return self._core.store

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

    def state_of(self, ref: ChunkRef) -> ChunkState:
        """What ``ref``'s KV encodes: its content, patch and the chained states of its antecedents."""
        return self._entry(ref).state

    @property
    def graph(self) -> nx.DiGraph:
        """The antecedent graph (edge A→B: B's KV encodes A), as a frozen copy.

        Nodes are every chunk the window knows, with ``in_window``, ``label`` and ``state`` (its
        `ChunkState`); each edge carries ``index`` (A's place among B's antecedents) and
        ``state`` (the digest of the state of A that B encodes).
        """
        graph = self._state.graph.copy()
        for ref, entry in self._state.entries.items():
            graph.nodes[ref].update(in_window=entry.in_window, label=ref.label, state=entry.state)
        return nx.freeze(graph)

    @property
    def stats(self) -> WindowStats:
        """Per-op and cumulative costs."""
        return self._state.book.snapshot()

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
        patch for the same antecedent states. Over capacity, the eviction policy makes room first.

        Mutates: the window (admits one chunk, may evict), the store (canonical, patch).
        """
        chunk = self._chunk(item, kind, caption, channel_order, label)
        plan, _ = self._transact("push", lambda planner: planner.push(self._state, chunk, label))
        return plan.admitted[0]

    def extend(self, items: Sequence[Item], *, labels: Sequence[str | None] | None = None) -> list[ChunkRef]:
        """Admit several items at the right end, in order, as one op: where their patches must
        be formed, one forward conditions them all (as a prefix cache prefills one request).

        Items are read as `push` reads them (with their default kinds; pass `Chunk` s, e.g. from
        ``window.backend.encoder.image(..., kind="screenshot")``, for other kinds or captions).
        Over capacity, the eviction policy makes room for all of them first.

        Mutates: the window (admits the chunks, may evict), the store.
        """
        chunks = self._labelled_chunks(items, labels)
        plan, _ = self._transact("extend", lambda planner: planner.extend(self._state, chunks))
        return list(plan.admitted)

    def replace(
        self,
        ref: ChunkRef,
        item: Item,
        *,
        label: str | None = None,
        kind: ChunkKind | None = None,
        caption: str | None = None,
        channel_order: ChannelOrder | None = None,
        append: Sequence[Item] = (),
        append_labels: Sequence[str | None] | None = None,
    ) -> ChunkRef:
        """Put ``item`` in ``ref``'s slot and evict ``ref`` (recallable), e.g. a screenshot by
        its caption or a page by its summary; ``append`` (read as `extend` reads its items)
        admits new chunks at the right end in the same op.

        The new chunk is conditioned on its left context (one forward of its tokens, shared
        with the appended chunks' where the engine supports gaps: a browsing agent's step is
        then one forward, as a prefix cache's is); the chunks to its right are survivors of
        ``ref``'s eviction: with ``survivors="keep"`` they keep their KV, which absorbed ``ref``
        itself (rotated by the change in length); with ``"removal"`` they are patched over their
        new left context.

        Returns:
            The replacement's ref (the appended ones are the window's last ``len(append)``).

        Mutates: the window (admits the chunks, evicts ``ref``, may evict more), the store.
        """
        self._in_window(ref)
        chunk = self._chunk(item, kind, caption, channel_order, label)
        extra = self._labelled_chunks(append, append_labels) if append else []
        plan, _ = self._transact(
            "replace", lambda planner: planner.replace(self._state, ref, chunk, label, extra)
        )
        return plan.admitted[0]

    def reorder(self, refs: Sequence[ChunkRef]) -> None:
        """Put the window's chunks in a new order (a permutation of `refs`).

        Each chunk relocates by rotation; one whose antecedents changed is served by its orbit
        patch (same set), a stored patch for its new antecedent states, or the reorder policy.

        Mutates: the window's order and patches; the store (patches formed).
        """
        self._transact("reorder", lambda planner: planner.reorder(self._state, refs))

    def slide(self, n: int = 1) -> list[ChunkRef]:
        """Evict the ``n`` leftmost chunks; returns them. Survivors only rotate (by default).

        Mutates: the window.
        """
        if n < 0:
            raise WindowError(f"slide needs n >= 0, got {n}")
        plan, _ = self._transact(
            "slide", lambda planner: planner.remove(self._state, self._state.order[:n], "slide")
        )
        return list(plan.evicted)

    def evict(self, ref: ChunkRef, *more: ChunkRef) -> None:
        """Take chunks out of the window (their canonicals and patches stay: recallable); several
        at once are one op, so survivors are settled once, not once per chunk.

        Raises:
            DuplicateChunkError: a chunk named twice.

        Mutates: the window.
        """
        refs = [ref, *more]
        if len(set(refs)) != len(refs):
            raise DuplicateChunkError("evict names a chunk twice; name each chunk once")
        for each in refs:
            self._in_window(each)
        self._transact("evict", lambda planner: planner.remove(self._state, refs, "evict"))

    def recall(self, ref: ChunkRef, at: int | None = None) -> ChunkRef:
        """Re-admit an evicted chunk at index ``at`` (default: the right end).

        No vision re-encode while its canonical is stored. Its patch comes from its original
        earlier context (default: stored at admission, so free) or the chunks now left of it;
        chunks after it are re-patched in order (``cascade``) or kept, as the plan says.

        Mutates: the window, the store (patches formed).
        """
        self._transact("recall", lambda planner: planner.recall(self._state, ref, at))
        return ref

    def forget(self, ref: ChunkRef) -> None:
        """Drop an evicted chunk for good: it can no longer be recalled (its store entries stay,
        shared with other windows). Chunks that still encode it keep their KV and state.

        Mutates: the window.
        """
        if self._entry(ref).in_window:
            raise ChunkInWindowError(f"{ref} is in the window; evict it before forgetting it")
        meter = CostMeter(forgotten=1)
        self._state.remove(ref)
        self._state.book.record("forget", meter.finish())

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
        on_text: Callable[[str], None] | None = None,
        in_message: bool = False,
        remember: bool = False,
    ) -> Answer:
        """Answer ``query`` over the window: greedy by default, sampled with a temperature.

        Args:
            on_text: called with each piece of the answer's text as it is decoded (streaming;
                text that may begin a stop string is held back until it cannot).
            in_message: conversation windows: the query ends the user message that the last
                chunks began (`push_message(..., closed=False)`), e.g. after its images.
            remember: conversation windows: admit the question and the answer as the
                conversation's next messages (one forward), so the next turn's history matches.

        Raises:
            SettingsError: ``in_message`` or ``remember`` on a window that holds no conversation.
        """
        if (in_message or remember) and self.conversation is None:
            raise SettingsError(
                "in_message and remember frame chat messages: create the window with conversation=True "
                "or a system_prompt"
            )
        config = DecodeConfig(
            self.config.max_new_tokens if max_new_tokens is None else max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            tuple(stop),
            return_logits,
            on_text,
        )
        query_ids = self._query_ids(query, opened=not in_message)
        self._core.check_fits(self._end(), query_ids, config)
        answer, cost = self._read("ask", lambda executor: executor.answer(query_ids, config))
        if temperature <= 0 and not in_message:
            self._state.last_answer = LastAnswer(query, self._state.tick, answer)
        if remember:
            assert self.conversation is not None
            asked = self.conversation.message("user", [query], opened=not in_message)
            replied = self.conversation.message("assistant", [answer.text])
            self._transact(
                "extend",
                lambda planner: planner.extend(self._state, [(c, c.label) for c in (*asked, *replied)]),
            )
        return replace(answer, cost=cost)

    def push_message(
        self,
        role: str,
        content: str | Sequence[MessagePart],
        *,
        opened: bool = True,
        closed: bool = True,
        labels: Sequence[str | None] | None = None,
    ) -> list[ChunkRef]:
        """Admit a chat message (``"user"``, ``"assistant"`` or ``"tool"``) at the right end: a chunk
        per part (text, images), framed by the chat template's role markers, as one op.

        ``opened=False`` continues a message the last chunks began; ``closed=False`` leaves it
        open for more parts or for the query (`ask(..., in_message=True)`).

        Raises:
            SettingsError: the window holds no conversation.
            InputError: an unknown role or an empty message.

        Mutates: the window (admits the chunks, may evict), the store.
        """
        if self.conversation is None:
            raise SettingsError(
                "push_message frames chat messages: create the window with conversation=True or a "
                "system_prompt (a plain window is one user turn: push its parts)"
            )
        parts = [content] if isinstance(content, str) else list(content)
        chunks = self.conversation.message(role, parts, opened=opened, closed=closed, labels=labels)
        chunks = [self._check_size(chunk) for chunk in chunks]
        labelled = [(chunk, chunk.label) for chunk in chunks]
        plan, _ = self._transact("extend", lambda planner: planner.extend(self._state, labelled))
        return list(plan.admitted)

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
        query_ids = self._query_ids(query)
        self._core.check_fits(self._end(), query_ids, config)

        def both(executor: Executor) -> tuple[Answer, Answer]:
            return self._with_answer(executor, query, query_ids, config), executor.answer_without(
                ref, query_ids, config
            )

        (with_chunk, without), cost = self._read("probe", both)
        kl = next_token_kl(with_chunk.first_logits, without.first_logits)
        agree = int(with_chunk.first_logits.argmax()) == int(without.first_logits.argmax())
        return Probe(with_chunk, without, kl, agree, kl < self.config.probe_threshold, cost)

    def probe_kl(self, ref: ChunkRef, query: str) -> float:
        """Next-token KL of ``query`` with ``ref`` switched off: ``probe_without``'s score alone."""
        return self.probe_without(ref, query, max_new_tokens=1).kl

    def fork(self) -> KameraWindow:
        """A copy-on-write branch: it shares the store (canonicals, patches); edits and the refs
        it mints stay in their branch."""
        branch = object.__new__(KameraWindow)
        branch.config, branch.backend, branch._core = self.config, self.backend, self._core
        branch.conversation = self.conversation
        branch._state = self._state.fork()
        return branch

    def plan(self, op: str, *args: Any, **kwargs: Any) -> Plan:
        """Dry run: the edits ``op`` ("push", "extend", "replace", "reorder", "slide", "evict",
        "recall") would do.

        Nothing runs and nothing changes: no forward, no store write, no store hit counted, no
        stats. Predicted forwards count a canonical prefill only when the canonical is not stored;
        under probe-driven eviction the plan lists the probes an overflowing push would run.
        """
        builders: dict[str, Callable[..., WindowPlan]] = {
            "push": lambda item, label=None, **kw: planner.push(
                self._state, self._chunk(item, label=label, **kw), label
            ),
            "extend": lambda items, labels=None: planner.extend(
                self._state, self._labelled_chunks(items, labels)
            ),
            "replace": lambda ref, item, label=None, append=(), append_labels=None, **kw: planner.replace(
                self._state,
                self._in_window(ref),
                self._chunk(item, label=label, **kw),
                label,
                self._labelled_chunks(append, append_labels) if append else [],
            ),
            "reorder": lambda refs: planner.reorder(self._state, refs),
            "slide": lambda n=1: planner.remove(self._state, self._state.order[:n], "slide"),
            "evict": lambda ref: planner.remove(self._state, [self._in_window(ref)], "evict"),
            "recall": lambda ref, at=None: planner.recall(self._state, ref, at),
        }
        if op not in builders:
            raise WindowError(f"unknown op {op!r}; plan one of {', '.join(builders)}")
        planner = self._planner(self.store)
        return builders[op](*args, **kwargs).public()

    def kv(self) -> Any:
        """The assembled cache of the window (anchor + placed chunks), as the backend holds it."""
        placed, _ = self._read("kv", lambda executor: executor.placements())
        return self._core.backend.assemble(placed)

    def chunk_kv(self, ref: ChunkRef) -> ChunkKV:
        """``ref``'s KV at its place in the window, exactly what ``state_of(ref)`` says it encodes
        (a lazily deferred patch is not formed by this read: the chunk is then its canonical)."""
        self._in_window(ref)
        kv, _ = self._read("kv", lambda executor: executor.placed_kv(ref), materialize=False)
        return kv

    def as_model_inputs(self, query: str | None = None) -> dict[str, Any]:
        """Keyword arguments for the model's own forward over a full re-prefill of the window
        (input ids, pixel values, grids, token types): the ground truth for exactness checks."""
        chunks = [self._state.entries[ref].chunk for ref in self._state.order]
        query_ids = None if query is None else self._query_ids(query)
        return self._core.backend.reference_inputs(chunks, query_ids)

    # -- transactions -------------------------------------------------------------------------
    def _labelled_chunks(
        self, items: Sequence[Item], labels: Sequence[str | None] | None
    ) -> list[tuple[Chunk, str | None]]:
        names = list(labels) if labels is not None else [None] * len(items)
        if len(names) != len(items):
            raise WindowError(f"got {len(items)} items but {len(names)} labels; give one label per item")
        return [(self._chunk(item, label=name), name) for item, name in zip(items, names, strict=True)]

    def _chunk(
        self,
        item: Item,
        kind: ChunkKind | None = None,
        caption: str | None = None,
        channel_order: ChannelOrder | None = None,
        label: str | None = None,
    ) -> Chunk:
        """The item as a chunk this window can hold (`chunk_of`, then `_check_size`)."""
        chunk = chunk_of(
            self._core.backend.encoder,
            item,
            kind,
            caption,
            channel_order,
            label,
            self.config.max_image_pixels,
        )
        return self._check_size(chunk)

    def _check_size(self, chunk: Chunk) -> Chunk:
        """Refuse a chunk the model's context cannot hold at all (every later ask would fail, and
        its prefill alone could exhaust memory); warn above ``config.large_chunk_tokens``."""
        limit = self._core.backend.context_limit
        needed = self._core.anchor.advance + chunk.advance + 1
        if limit is not None and needed > limit:
            raise ContextOverflowError(
                f"a chunk of {chunk.num_tokens} tokens ({chunk.advance} positions) cannot fit the model's "
                f"context of {limit} with the anchor ({self._core.anchor.advance}) and one query token; "
                "split or shorten it"
            )
        large = self.config.large_chunk_tokens
        if large is not None and chunk.num_tokens > large:
            warnings.warn(
                f"a chunk of {chunk.num_tokens} tokens (over large_chunk_tokens={large}): its prefill is "
                "slow and its KV large; split it, or raise WindowConfig.large_chunk_tokens",
                LargeChunkWarning,
                stacklevel=4,
            )
        return chunk

    def _transact(self, op: str, build: Callable[[Planner], WindowPlan]) -> tuple[WindowPlan, OpCost]:
        """Plan and execute ``op`` as one transaction over window and store; record its cost."""
        plan, (_, cost) = self._run(op, build, None)
        return plan, cost

    def _read(self, op: str, read: Callable[[Executor], T], materialize: bool = True) -> tuple[T, OpCost]:
        """Read the window (ask, probe, kv) in one transaction, lazy patches formed first."""
        idle = WindowPlan(op, tuple(self._state.order))
        build = (lambda planner: planner.materialize(self._state)) if materialize else (lambda planner: idle)
        _, (value, cost) = self._run(op, build, read)
        assert value is not None
        return value, cost

    def _run(
        self, op: str, build: Callable[[Planner], WindowPlan], read: Callable[[Executor], T] | None
    ) -> tuple[WindowPlan, tuple[T | None, OpCost]]:
        meter = CostMeter()
        for _ in range(_ATTEMPTS):
            snapshot = self._state.copy()
            txn = Txn(StagedStore(self.store), meter)
            try:
                plan = build(self._planner(txn.store))
                if plan.probes:
                    self._score(plan, txn)
                    plan = build(self._planner(txn.store))
                executor = Executor(self._state, self._core, txn, self.config)
                executor.run(plan)
                value = read(executor) if read is not None else None
            except StaleLookup:
                self._state = _restored(snapshot)
                continue
            except BaseException:
                self._state = _restored(snapshot)
                raise
            txn.commit()
            release_evicted(self._state, self.store, self.config, plan.evicted, meter)
            cost = meter.finish()
            self._state.book.record(op, cost)
            return plan, (value, cost)
        raise WindowError(f"{op}: the store kept changing under the operation; try it again")

    def _score(self, plan: WindowPlan, txn: Txn) -> None:
        """Run the probes a probe-driven eviction asked for; remember their KLs for the re-plan."""
        executor = Executor(self._state, self._core, txn, self.config)
        executor.run(self._planner(txn.store).materialize(self._state))
        query, config = plan.probe_query, DecodeConfig(max_new_tokens=1)
        query_ids = self._query_ids(query)
        with_chunk = self._with_answer(executor, query, query_ids, config)
        kl = {
            ref: next_token_kl(
                with_chunk.first_logits, executor.answer_without(ref, query_ids, config).first_logits
            )
            for ref in plan.probes
        }
        txn.meter.probes += len(kl)
        self._state.scores = Scores(query, self._state.tick, kl)

    def _with_answer(
        self, executor: Executor, query: str, query_ids: torch.Tensor, config: DecodeConfig
    ) -> Answer:
        """The last greedy answer to ``query`` when the window has not changed since, else a decode."""
        last = self._state.last_answer
        if last is not None and last.query == query and last.tick == self._state.tick:
            return last.answer
        return executor.answer(query_ids, config)

    def _planner(self, view: StoreView) -> Planner:
        core, layout = self._core, self._core.backend.layout
        inputs = PlanInputs(
            config=self.config,
            view=view,
            root=core.root,
            features=layout.features,
            kv_bytes_per_token=layout.bytes_per_token(core.backend.dtype),
            anchor_ready=core.anchor_ready,
            query_tokens=lambda query: int(self._query_ids(query).shape[0]),
            gaps=core.backend.supports_gaps,
        )
        return Planner(inputs)

    def query_ids(self, query: str, *, in_message: bool = False) -> torch.Tensor:
        """The token ids ``ask`` would decode ``query`` from (its framing included)."""
        return self._query_ids(query, opened=not in_message)

    # -- helpers -------------------------------------------------------------------------------
    def _query_ids(self, query: str, opened: bool = True) -> torch.Tensor:
        if self.conversation is not None:
            return self.conversation.query_ids(query, opened=opened)
        return self._core.backend.encoder.query_ids(query)

    def _end(self) -> int:
        entries = self._state.entries
        return self._core.anchor.advance + sum(entries[r].chunk.advance for r in self._state.order)

    def _entry(self, ref: ChunkRef) -> Entry:
        if not isinstance(ref, ChunkRef):
            raise UnknownChunkError(f"expected a ChunkRef from this window, got {type(ref).__name__}")
        entry = self._state.entries.get(ref)
        if entry is None:
            raise UnknownChunkError(
                f"{ref} does not belong to this window (another window's or branch's ref, or forgotten)"
            )
        return entry

    def _in_window(self, ref: ChunkRef) -> ChunkRef:
        if not self._entry(ref).in_window:
            raise UnknownChunkError(f"{ref} is not in the window (evicted); recall it first")
        return ref


def _restored(snapshot: WindowState) -> WindowState:
    """The snapshot an op failed back to, without the assembled cache: the op may have cropped
    or extended that engine cache in place, so it no longer holds what the snapshot says."""
    snapshot.assembled = None
    return snapshot
