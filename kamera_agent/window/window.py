"""KameraWindow: the deque of chunks an agent's model attends to, edited without re-prefill.

    window = KameraWindow(model, processor)
    frame = window.push(image)            # formed once (store hit: free), patched on its left context
    window.slide()                        # oldest leaves; survivors only rotate
    window.recall(frame)                  # back from the store: rotation + its stored patch
    answer = window.ask("What changed?")  # anchor + relocated, patched chunks -> decode

The window is a face over its parts: `WindowParts` (settings, engine, the engine-neutral
`KVCore` over the store, the window's encoder), an `OpRunner` that runs each op as one
transaction over the window's `WindowRecord` (a pure `Planner`, then an `Executor`), `Inputs`
that read what a user passes, and the dry-run view ``window.plan``, which runs the ops
themselves with the runner planning instead of executing. Every operation's cost lands in
``window.stats``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.chunks.chat import ChatTemplate
from kamera_agent.chunks.chunk import Chunk, ChunkKind
from kamera_agent.chunks.sources import ChannelOrder
from kamera_agent.config import WindowConfig
from kamera_agent.core.kv_core import KVCore
from kamera_agent.errors import (
    ArgumentError,
    ChunkInWindowError,
    DuplicateChunkError,
    SettingsError,
)
from kamera_agent.fidelity import window_budget
from kamera_agent.results import Answer, OpCost
from kamera_agent.settings import THREADS_ENV, configure_threads
from kamera_agent.store import ChunkStore
from kamera_agent.window.arguments import (
    check_callable,
    check_choice,
    check_decode,
    check_flag,
    check_index,
    check_items,
    check_labels,
    check_slide,
    check_text,
)
from kamera_agent.window.conversation import Conversation, MessagePart
from kamera_agent.window.dry_run import PlanView
from kamera_agent.window.inputs import Inputs
from kamera_agent.window.reads import WindowReads
from kamera_agent.window.runner import OpRunner, WindowParts
from kamera_agent.window.setup import Item, resolve_backend, resolve_store
from kamera_agent.window.state import ChunkRef, LastAnswer, WindowRecord

__all__ = ["KameraWindow"]


class KameraWindow(WindowReads):
    """A window of chunks over one model, with position-free reuse of every chunk's KV.

    Args:
        model: a loaded transformers model, a local checkpoint path, or a `Backend`.
        processor: the model's processor, if it has a full one.
        tokenizer: the tokenizer, when no processor is given.
        image_processor: the image processor, when no processor is given (VLMs).
        config: how the window behaves (`WindowConfig`); default ``WindowConfig()``.
        store: a `ChunkStore` to share between windows of the same model (default: one built
            from the config's ``memory_limit``, ``disk_dir``, ``disk_limit`` and ``store_url``).
        conversation: hold a chat (`push_message`; questions are framed as user messages) rather
            than one user turn; implied by ``system_prompt``.
        system_prompt: the conversation's system prompt (it is the window's anchor: fixed,
            never moved); ``None`` with ``conversation=True``: the chat template's default.
        cache_salt: key the window's chunks in the namespace an engine's requests with this
            ``cache_salt`` use (vLLM's, SGLang's): a window and a salted agent share their
            entries on one store, and the drift audits this window's budget files vouch for the
            kept states the engine may serve them (`kamera_agent.engines.synthesis`). ``None``:
            the namespace of unsalted requests.

    Attributes:
        plan: dry runs of every op, typed like the ops (``window.plan.reorder(refs)``), also
            callable with the op's name (``window.plan("reorder", refs)``): `PlanView`; each
            runs the op itself, planning instead of executing, so it plans what the op does.

    Raises:
        SettingsError: a setting that cannot apply (``device``/``dtype`` for a `Backend` built
            elsewhere, store settings together with ``store=``).
        UnsupportedModelError: a conversation on a model whose chat template cannot frame
            messages as movable chunks (`ChatTemplate`); an MLA model on a backend without MLA.
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
        cache_salt: str | None = None,
    ) -> None:
        if model is None:
            raise ArgumentError(
                "KameraWindow needs a model: a loaded transformers model, a checkpoint path or a Backend"
            )
        if config is not None and not isinstance(config, WindowConfig):
            raise ArgumentError(f"config must be a WindowConfig, got {type(config).__name__}")
        if store is not None and not isinstance(store, ChunkStore):
            raise ArgumentError(f"store must be a ChunkStore, got {type(store).__name__}")
        conversation = check_flag(conversation, "conversation")
        system_prompt = check_text(system_prompt, "system_prompt", optional=True)
        cache_salt = check_text(cache_salt, "cache_salt", optional=True)
        if cache_salt == "":
            raise ArgumentError("cache_salt must name a namespace (a non-empty str), or be None for none")
        config = config or WindowConfig()
        if config.threads is not None or THREADS_ENV in os.environ:
            configure_threads(config.threads)  # the setting, else $KAMERA_NUM_THREADS
        backend = resolve_backend(model, processor, tokenizer, image_processor, config)
        encoder, framing = backend.encoder, None
        if cache_salt is not None:  # an engine's salted requests key their chunks in "|<salt>"
            encoder = encoder.in_namespace(f"|{cache_salt}")
        if conversation or system_prompt is not None:
            template = ChatTemplate.from_tokenizer(encoder.tokenizer, encoder.prompt)
            encoder = encoder.with_prompt(template.prompt_format(system_prompt))
            framing = Conversation(template, encoder, config.max_image_pixels)
        store = resolve_store(backend, config, store)
        config, budget = window_budget(config, backend.fingerprint, store, backend.supports_recompute)
        core = KVCore(backend, store, encoder)
        self._setup(WindowParts(config, backend, core, framing, budget), WindowRecord())

    def _setup(self, parts: WindowParts, state: WindowRecord) -> None:
        """Every window, new or forked, is built here from its shared parts and its own state."""
        self._parts = parts
        self._runner = OpRunner(parts, state)
        self._inputs = Inputs(self._runner)
        self.plan = PlanView(self, self._runner)

    @classmethod
    def _branch(cls, parts: WindowParts, state: WindowRecord) -> KameraWindow:
        window = cls.__new__(cls)
        window._setup(parts, state)
        return window

    def close(self) -> None:
        """Close the window's store (`ChunkStore.close`: its memory entries written to its disk
        tier, the directory released, shared writes finished). Closing a store passed in with
        ``store=`` is its owner's call: this closes it too."""
        self.store.close()

    @property
    def cache_bytes(self) -> int:
        """Bytes of the engine cache the window keeps for its next answer, spare capacity
        included (0: it keeps none): what `release_cache` frees."""
        assembled = self._runner.state.assembled
        return 0 if assembled is None else self.backend.cache_nbytes(assembled.cache)

    def release_cache(self) -> int:
        """Drop the engine cache kept for the next answer (a server bounding its windows' memory
        does): the next answer assembles the window again from its chunks' KV, placed from the
        store (formed again only where the store has dropped it). Returns the bytes freed."""
        with self._runner.lock:
            freed = self.cache_bytes
            self._runner.state.assembled = None
            return freed

    def __enter__(self) -> KameraWindow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        chunk = self._inputs.item(item, kind, caption, channel_order, label)
        plan, _ = self._runner.transact(
            "push", lambda planner: planner.push(self._runner.state, chunk, label)
        )
        return plan.admitted[0]

    def extend(self, items: Sequence[Item], *, labels: Sequence[str | None] | None = None) -> list[ChunkRef]:
        """Admit several items at the right end, in order, as one op: where their patches must
        be formed, one forward conditions them all (as a prefix cache prefills one request).

        Items are read as `push` reads them (with their default kinds; pass `Chunk` s, e.g. from
        ``window.encoder.image(..., kind="screenshot")``, for other kinds or captions).
        Over capacity, the eviction policy makes room for all of them first.

        Mutates: the window (admits the chunks, may evict), the store.
        """
        chunks = self._inputs.labelled(items, labels)
        plan, _ = self._runner.transact("extend", lambda planner: planner.extend(self._runner.state, chunks))
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
        self._inputs.in_window(ref)
        chunk = self._inputs.item(item, kind, caption, channel_order, label)
        extra = [] if append is None else self._inputs.labelled(append, append_labels)
        plan, _ = self._runner.transact(
            "replace", lambda planner: planner.replace(self._runner.state, ref, chunk, label, extra)
        )
        return plan.admitted[0]

    def reorder(self, refs: Sequence[ChunkRef]) -> None:
        """Put the window's chunks in a new order (a permutation of `refs`).

        Each chunk relocates by rotation; one whose antecedents changed is served by its orbit
        patch (same set), a stored patch for its new antecedent states, or the reorder policy.

        Mutates: the window's order and patches; the store (patches formed).
        """
        order = check_items(refs, "refs")
        self._runner.transact("reorder", lambda planner: planner.reorder(self._runner.state, order))

    def slide(self, n: int = 1) -> list[ChunkRef]:
        """Evict the ``n`` leftmost chunks; returns them. Survivors relocate, re-formed where the
        drift budget expects them past ε.

        Mutates: the window.
        """
        runner = self._runner
        n = check_slide(n, len(runner.state.order))
        plan, _ = runner.transact(
            "slide", lambda planner: planner.remove(runner.state, runner.state.order[:n], "slide")
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
        for each in refs:
            self._inputs.entry(each)  # a ChunkRef of this window's, before they are hashed
        if len(set(refs)) != len(refs):
            raise DuplicateChunkError("evict names a chunk twice; name each chunk once")
        for each in refs:
            self._inputs.in_window(each)
        self._runner.transact("evict", lambda planner: planner.remove(self._runner.state, refs, "evict"))

    def recall(self, ref: ChunkRef, at: int | None = None) -> ChunkRef:
        """Re-admit an evicted chunk at index ``at`` (default: the right end).

        No vision re-encode while its canonical is stored. Its patch comes from its original
        earlier context (default: stored at admission, so free) or the chunks now left of it;
        chunks after it are re-patched in order (``cascade``) or kept, as the plan says.

        Mutates: the window, the store (patches formed).
        """
        at = check_index(at, "at")
        self._runner.transact("recall", lambda planner: planner.recall(self._runner.state, ref, at))
        return ref

    def arrange(
        self, items: Sequence[ChunkRef | Item], *, labels: Sequence[str | None] | None = None
    ) -> list[ChunkRef]:
        """Make the window hold exactly ``items``, in this order, as one op; returns their refs.

        A ref in the window stays (moved where it stands), an evicted ref comes back (recalled),
        anything else is new content, read as `push` reads it; in-window chunks not named are
        evicted. Every chunk is settled once, and the op never prefills more than re-prefilling
        from its first changed slot. ``labels``: one per item (``None`` for refs).

        Raises:
            DuplicateChunkError: a ref named twice.
            CapacityError: more than the window's capacity.
            ChunkLostError: an evicted ref that can no longer be recalled (push its content).

        Mutates: the window, the store.
        """
        items = check_items(items, "items")
        names = check_labels(labels, len(items))
        parsed: list[ChunkRef | tuple[Chunk, str | None]] = []
        for item, name in zip(items, names, strict=True):
            if isinstance(item, ChunkRef):
                parsed.append(item)
            else:
                parsed.append((self._inputs.item(item, None, None, None, name), name))
        plan, _ = self._runner.transact(
            "arrange", lambda planner: planner.arrange(self._runner.state, parsed)
        )
        return list(plan.order)

    def forget(self, ref: ChunkRef) -> None:
        """Drop an evicted chunk for good: it can no longer be recalled (its store entries stay,
        shared with other windows). Chunks that still encode it keep their KV and state.

        Mutates: the window.
        """
        with self._runner.lock:
            self._runner.check_open()
            if self._inputs.entry(ref).in_window:
                raise ChunkInWindowError(f"{ref} is in the window; evict it before forgetting it")
            state = self._runner.state
            state.remove(ref)
            state.book.record("forget", OpCost(forgotten=1))

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
        check_text(role, "role")
        check_flag(opened, "opened")
        check_flag(closed, "closed")
        parts = [content] if isinstance(content, str) else check_items(content, "content")
        message = self._inputs.conversation().message(
            role, parts, opened=opened, closed=closed, labels=labels
        )
        chunks = [(self._inputs.check_size(chunk), chunk.label) for chunk in message]
        plan, _ = self._runner.transact("extend", lambda planner: planner.extend(self._runner.state, chunks))
        return list(plan.admitted)

    def ask(
        self,
        query: str,
        *,
        decode: DecodeConfig | None = None,
        on_text: Callable[[str], None] | None = None,
        keep_going: Callable[[], bool] | None = None,
        return_logits: bool = False,
        in_message: bool = False,
        remember: bool = False,
        query_role: str = "user",
        answer_start: str = "",
        **deprecated: Any,
    ) -> Answer:
        """Answer ``query`` over the window: greedy by default, sampled with a temperature.

        Args:
            decode: how to decode (`DecodeConfig`: length, sampling, stop strings, OpenAI's
                logit bias and penalties, log-probabilities, a grammar); ``None``: greedy, up to
                ``config.max_new_tokens`` tokens. Its settings are used as they are (they were
                checked when it was built).
            on_text: called with each piece of the answer's text as it is decoded (streaming;
                text that may begin a stop string is held back until it cannot).
            keep_going: asked before each answer token; ``False`` ends the answer there
                (``finish_reason="cancelled"``): a server stops when its client goes away.
            return_logits: return every answer step's logits (`Answer.logits`).
            in_message: conversation windows: the query ends the user message that the last
                chunks began (`push_message(..., closed=False)`), e.g. after its images.
            remember: conversation windows: admit the question and the answer as the
                conversation's next messages (one forward), so the next turn's history matches.
            query_role: conversation windows: the role of the message ``query`` is, ``"user"``
                (a question) or ``"tool"`` (an agent's turn ending in a tool's output).
            answer_start: the opening of the answer, which the model continues (a chat API's
                final assistant message under ``continue_final_message``); the answer's text is
                the continuation alone.
            deprecated: the decode settings as keywords (``max_new_tokens=8``, ``temperature``,
                ...): still taken, with a `DeprecationWarning`; use ``decode``.

        Raises:
            SettingsError: ``in_message``, ``remember`` or a ``query_role`` other than ``user``
                on a window that holds no conversation.
            ArgumentError: a ``query_role`` other than ``user`` or ``tool``; ``decode`` and a
                decode keyword both given.
        """
        query_ids, query_role = self._framed(query, query_role, in_message, remember, answer_start)
        settings = check_decode(decode, deprecated, self.config.max_new_tokens)
        config = settings.with_hooks(
            on_text=check_callable(on_text, "on_text"),
            keep_going=check_callable(keep_going, "keep_going"),
            return_logits=check_flag(return_logits, "return_logits"),
        )
        with self._runner.lock:  # the answer, the remembered answer and the messages: one call
            self._runner.check_open()
            self._parts.core.check_fits(self._runner.end(), query_ids, config)
            answer, cost = self._runner.read("ask", lambda executor: executor.answer(query_ids, config))
            if _reusable(config) and not in_message and query_role == "user" and not answer_start:
                self._runner.state.last_answer = LastAnswer(query, self._runner.state.tick, answer)
            if remember:
                self._remember(query, answer_start + answer.text, opened=not in_message, role=query_role)
        return replace(answer, cost=cost)

    def _framed(
        self, query: str, query_role: str, in_message: bool, remember: bool, answer_start: str
    ) -> tuple[torch.Tensor, str]:
        """``ask``'s query ids and role, its chat framing checked: the query's role, and a
        conversation wherever framing is asked for."""
        check_text(query, "query")
        check_text(answer_start, "answer_start")
        query_role = check_choice(query_role, "query_role", ("user", "tool"))
        framed = [check_flag(in_message, "in_message"), check_flag(remember, "remember")]
        if (any(framed) or query_role != "user") and self.conversation is None:
            raise SettingsError(
                "in_message, remember and query_role frame chat messages: create the window with "
                "conversation=True or a system_prompt"
            )
        ids = self._parts.query_ids(query, opened=not in_message, role=query_role, answer_start=answer_start)
        return ids, query_role

    def _remember(self, query: str, answer: str, opened: bool, role: str = "user") -> None:
        """The question and its answer admitted as the conversation's next messages (one op)."""
        assert self.conversation is not None
        asked = self.conversation.message(role, [query], opened=opened)
        replied = self.conversation.message("assistant", [answer])
        chunks = [(chunk, chunk.label) for chunk in (*asked, *replied)]
        self._runner.transact("extend", lambda planner: planner.extend(self._runner.state, chunks))

    def fork(self) -> KameraWindow:
        """A copy-on-write branch: it shares the store (canonicals, patches), the engine and the
        encoder; edits and the refs it mints stay in their branch."""
        with self._runner.lock:
            self._runner.check_open()
            return KameraWindow._branch(self._parts, self._runner.state.fork())


def _reusable(config: DecodeConfig) -> bool:
    """Whether an answer decoded with ``config`` is the one a probe's greedy answer with the
    chunk would be (greedy, unbiased, unconstrained), so the probe may reuse it."""
    plain = not (config.logit_bias or config.presence_penalty or config.frequency_penalty)
    return config.temperature <= 0 and plain and config.constraint is None
