"""One model behind chat completions: requests become window edits, answers carry true usage.

Why a class apart from the HTTP app: everything that decides what a request costs (which
tenant and session, which ops, what was reused) is plain Python, testable without sockets.

No single request can hold or kill it:

- everything is bounded before it costs: a tenant's place in the server is taken first (429
  past ``max_queued``), ``n × max_tokens`` is within the decode limit, every text is short
  enough to fit the context by its length alone before it is tokenized (`TextBound`), schemas
  are bounded before they are compiled, images are charged against pixel limits from their
  headers before they are decoded (`PixelLimit`), and every cache is held by bytes;
- all of that runs outside the model; the model runs one forward at a time, in turns
  (`ModelTurns`): a request hands the model on between decode steps to those waiting, so a
  short request waits for steps, not for another's whole answer;
- a request's settings travel with it from admission to its window (`Fidelity`).

Tenants learn nothing of each other: besides their sessions, every store entry a tenant's
requests make or read (canonicals, vision outputs, full states, patches, audits) is keyed in its
own namespace (`ServeSettings.cache_salt`), unless the server shares content on purpose.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kamera_agent.backends.base import Backend, DecodeConfig
from kamera_agent.backends.decoding import decoded_tokens
from kamera_agent.config import WindowConfig
from kamera_agent.errors import ConfigError, ContextOverflowError, KameraError
from kamera_agent.results import Answer, OpCost
from kamera_agent.serve.bounds import TextBound, longest_token_bytes
from kamera_agent.serve.completion import Completion, called, logprobs_of
from kamera_agent.serve.fidelity import Fidelity, fidelity_for
from kamera_agent.serve.media import MediaAccess
from kamera_agent.serve.messages import MessageChunks, Prepared
from kamera_agent.serve.metrics import Metrics
from kamera_agent.serve.pixels import PixelLimit
from kamera_agent.serve.protocol import ChatRequest, RequestError
from kamera_agent.serve.responses import ResponseStore
from kamera_agent.serve.scheduler import ModelTurns, Turn
from kamera_agent.serve.sessions import Session, SessionPool
from kamera_agent.serve.settings import DEFAULT_TENANT, ServeSettings
from kamera_agent.serve.structured import Constraints
from kamera_agent.serve.sync import SyncReport, sync_window
from kamera_agent.serve.timing import Clock
from kamera_agent.serve.tools import CallFilter, ToolFormat, system_with_tools, tool_format_for
from kamera_agent.serve.turns import ImagePart, ImageReader, read_turns
from kamera_agent.serve.turns import Turn as Message
from kamera_agent.serve.usage import PromptSplit
from kamera_agent.store import ChunkStore
from kamera_agent.window import KameraWindow
from kamera_agent.window.setup import resolve_store

__all__ = ["DEFAULT_TENANT", "Completion", "KameraServer", "ServeSettings"]

Streamed = Callable[[str], None] | None
KeepGoing = Callable[[], bool] | None


@dataclass(frozen=True)
class _Asked:
    """A request read and prepared outside the model: what answering it in its turn needs."""

    request: ChatRequest
    tenant: str
    fidelity: Fidelity
    system: str | None
    digests: list[str]
    prepared: Prepared
    query_tokens: int
    clock: Clock
    decode: DecodeConfig
    """The request's decode settings, built once (choice ``i``'s: ``decode.for_choice(i)``)."""


class KameraServer:
    """Sessions of conversation windows over one backend and one shared store, by tenant."""

    def __init__(self, backend: Backend, settings: ServeSettings) -> None:
        if settings.reuse not in ("kamera", "prefix"):
            raise ConfigError(f"reuse {settings.reuse!r}: 'kamera' or 'prefix' (a prefix cache)")
        self.backend, self.settings = backend, settings
        self.store: ChunkStore = resolve_store(backend, settings.config, None)
        access = MediaAccess(settings.fetching, settings.local_media)
        max_pixels = settings.config.max_image_pixels
        self.images = ImageReader(access, max_pixels=max_pixels, limit=settings.image_cache_bytes)
        self.messages = MessageChunks(
            backend, self.images, settings.chunk_cache_bytes, max_pixels, settings.anchor_cache_bytes
        )
        self.sessions = SessionPool(self._window, settings.max_sessions, settings.idle_seconds)
        self.metrics = Metrics(self._gauges, lambda: self.store.stats().tiers)
        self.turns = ModelTurns()
        """The model's turns: one request at a time, handed on between decode steps."""
        self.pixels = PixelLimit(settings.image_bytes_in_flight, settings.tenant_image_bytes_in_flight)
        """Working memory of images being decoded, by tenant and in all."""
        tokenizer = backend.encoder.tokenizer
        self.text = TextBound(backend.context_limit, longest_token_bytes(tokenizer))
        """The longest text a request may send (by characters, before any tokenizer runs)."""
        self._queued: Counter[str] = Counter()
        self._queue_lock = threading.Lock()
        self.responses = ResponseStore()
        """Stored responses (``/v1/responses``), per tenant bounded."""
        self.tool_format: ToolFormat = tool_format_for(tokenizer)
        """How the model's template writes tool calls (rendered history, parsed answers, grammar)."""
        self.constraints = Constraints(tokenizer, self.tool_format, settings.schema)

    def complete(
        self,
        request: ChatRequest,
        *,
        tenant: str = DEFAULT_TENANT,
        on_text: Streamed = None,
        keep_going: KeepGoing = None,
        arrived: float | None = None,
    ) -> Completion:
        """Serve one request of ``tenant`` (streaming through ``on_text`` when given; ended
        early when ``keep_going`` says so: the client went away), timed from ``arrived``
        (``time.perf_counter()`` when the request reached the server; default: now).

        Raises:
            RequestError: anything the request asks that cannot be served (4xx), or 429 when the
                tenant already has ``max_queued`` requests in the server or its images find no
                room in the pixel limits now.
        """
        clock = Clock() if arrived is None else Clock(arrived)
        self._refuse_unserved(request)
        with self._admitted(tenant):  # before any work a tenant past its place would only queue
            prefix_only = self.settings.reuse == "prefix"
            fidelity = fidelity_for(self.settings.config, request.kamera, prefix_only=prefix_only)
            system, turns = read_turns(
                request.messages,
                self.settings.limits,
                self.tool_format,
                self.text,
                continues=request.continue_final_message,
            )
            self._refuse_images(turns)
            if request.tools:  # the definitions belong to the system block: the conversation's anchor
                system = self._with_tools(system, request.tools)
            decode = request.decode_config(self.settings.max_tokens, self.constraints.of(request))
            salt = self.settings.cache_salt(tenant)
            with self.pixels.lease(tenant) as lease:  # images, tokens, keys: outside the model
                prepared = self.messages.prepare(system, turns, lease, salt)
            query_tokens = self._fitting_query_tokens(system, prepared, salt)
            digests = [turn.digest for turn in (turns[:-1] if request.continue_final_message else turns)]
            clock.stamp_ready()
            asked = _Asked(request, tenant, fidelity, system, digests, prepared, query_tokens, clock, decode)
            return self._answer(asked, on_text, keep_going)

    def _refuse_unserved(self, request: ChatRequest) -> None:
        """A field not served, another model, or more decoding than one request may ask."""
        request.refuse_unsupported()
        if request.model != self.settings.model_name:
            raise RequestError(
                404,
                f"model {request.model!r} is not served here; it serves {self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )
        tokens = request.n * (request.answer_tokens or self.settings.max_tokens)
        if tokens > self.settings.max_decode_tokens:
            raise RequestError(
                400,
                f"n × max_tokens asks for {tokens:,} tokens; this server decodes at most "
                f"{self.settings.max_decode_tokens:,} for one request: ask for fewer",
                param="max_tokens",
            )

    def _refuse_images(self, turns: list[Message]) -> None:
        """Images sent to a model that reads text only: refused by the part, before any is read."""
        encoder = self.backend.encoder
        if encoder.image_processor is not None and encoder.prompt.image_token is not None:
            return
        for turn in turns:
            for part in turn.parts:
                if isinstance(part, ImagePart):
                    raise RequestError(
                        400, f"{part.where}: this model reads text only; send no images", param="messages"
                    )

    def _with_tools(self, system: str | None, tools: list[dict[str, object]]) -> str:
        """The system prompt with the tools rendered in it, each bounded by its length first."""
        try:
            written = json.dumps(tools, ensure_ascii=False)
        except (RecursionError, ValueError, TypeError) as exc:
            raise RequestError(400, "tools: not JSON the server can write", param="tools") from exc
        self.text.check(len(written), "tools", param="tools")
        tokenizer = self.backend.encoder.tokenizer
        rendered = system_with_tools(tokenizer, self.messages.template, system, tools)
        self.text.check(len(rendered), "the system prompt with its tools", param="tools")
        return rendered

    def _answer(self, asked: _Asked, on_text: Streamed, keep_going: KeepGoing) -> Completion:
        request = asked.request
        calls = CallFilter(on_text, self.tool_format) if on_text is not None and request.calls_tools else None
        if calls is not None:
            on_text = calls  # a call is sent as tool_calls, never as text
        with self.turns.turn() as turn:
            asked.clock.stamp_started()
            session = self._claim(turn, asked)
            try:
                done = self._serve(session, asked, turn, on_text, keep_going)
            finally:
                session.busy = False
                self.metrics.released(self.sessions.bound_caches(self.settings.window_cache_bytes))
        asked.clock.stamp_finished()
        if calls is not None:
            calls.flush(done.calls[0].content)
        asks = [("ask", each.cost or OpCost()) for each in done.answers]
        ops = [(op, cost) for op, _, cost in done.report.ops] + asks
        cancelled = done.answer.finish_reason == "cancelled"
        usage = done.usage()
        self.metrics.served(usage, done.split, done.tokens_prefilled, ops, cancelled=cancelled)
        self.metrics.timed(asked.clock, usage["completion_tokens"])
        return done

    def _claim(self, turn: Turn, asked: _Asked) -> Session:
        """The request's session, held for it (one pinned to a busy session waits for it,
        giving up the model meanwhile)."""
        while True:
            session = self.sessions.session_for(
                asked.tenant, asked.request.pinned, asked.system, asked.fidelity, asked.digests
            )
            if not session.busy:
                session.busy = True
                return session
            turn.wait_until(_freed(session))

    def _serve(
        self, session: Session, asked: _Asked, turn: Turn, on_text: Streamed, keep_going: KeepGoing
    ) -> Completion:
        """The window edit and the answers, in the request's turn."""
        window = session.window
        try:
            report = sync_window(window, asked.prepared, prefix_only=self.settings.reuse == "prefix")
            stepping = _turn_taking(turn, asked.clock, keep_going)
            answers = self._decode(window, report, asked, stepping, on_text)
        except ContextOverflowError as exc:
            raise RequestError(400, str(exc), param="messages", code="context_length_exceeded") from exc
        except KameraError as exc:
            raise RequestError(400, str(exc), param="messages") from exc
        session.digests = asked.digests
        assert report.provenance is not None
        report.provenance.saw(window.last_plan)  # lazily deferred patches the answer formed
        split = report.provenance.split(window, asked.query_tokens)
        estimates = [window.drift_of(ref) for ref in window.refs]
        largest = None if None in estimates else max((e for e in estimates if e is not None), default=0.0)
        drift = {"budget": window.budget, "largest": largest}
        return self._completion(asked, session, (report, answers, split), drift, turn.waited)

    def _decode(
        self,
        window: KameraWindow,
        report: SyncReport,
        asked: _Asked,
        keep_going: KeepGoing,
        on_text: Streamed,
    ) -> list[Answer]:
        """``n`` answers over one prefill of the prompt (choice ``i`` seeded ``seed + i``)."""
        return [
            window.ask(
                "",  # the last message is chunks: the question is its closing framing
                decode=asked.decode.for_choice(choice),
                on_text=on_text,
                keep_going=keep_going,
                in_message=True,
                query_role=asked.prepared.role,
                answer_start=asked.prepared.answer_start,
            )
            for choice in range(asked.request.n)
        ]

    def _completion(
        self,
        asked: _Asked,
        session: Session,
        served: tuple[SyncReport, list[Answer], PromptSplit],
        drift: dict[str, float | None],
        waited: int,
    ) -> Completion:
        report, answers, split = served
        request = asked.request
        asks = [each.cost or OpCost() for each in answers]
        spent = report.cost.tokens_prefilled + sum(
            cost.tokens_prefilled - decoded_tokens(each) for cost, each in zip(asks, answers, strict=True)
        )
        tokenizer = self.backend.encoder.tokenizer
        return Completion(
            f"chatcmpl-{uuid.uuid4().hex[:24]}",
            int(time.time()),
            self.settings.model_name,
            session.id,
            answers[0],
            report,
            split,
            spent,
            tuple(answers[1:]),
            tuple(logprobs_of(each, tokenizer) for each in answers),
            tuple(called(each, request.parallel_tool_calls, self.tool_format) for each in answers)
            if request.calls_tools
            else (),
            drift,
            waited,
            asked.clock,
        )

    def _fitting_query_tokens(self, system: str | None, prepared: Prepared, salt: str | None) -> int:
        """The question's tokens (tokenized once, outside the model), refusing a prompt (its
        messages and the question) that cannot fit the model's context behind the system prompt."""
        framing = self.messages.framing(system, salt)
        role = prepared.role
        ids = framing.conversation.query_ids("", opened=False, role=role, answer_start=prepared.answer_start)
        tokens = int(ids.shape[0])
        limit = self.backend.context_limit
        held = sum(chunk.advance for chunk in prepared.chunks)
        if limit is not None and framing.anchor_tokens + held + tokens >= limit:
            raise RequestError(
                400,
                f"the messages take {held} positions and the answer's framing {tokens} tokens behind a "
                f"system prompt of {framing.anchor_tokens}; the model has {limit}: shorten them",
                param="messages",
                code="context_length_exceeded",
            )
        return tokens

    @contextmanager
    def _admitted(self, tenant: str) -> Iterator[None]:
        """A place for one more request of ``tenant`` while it runs, or 429 when it has
        ``max_queued`` already (taken before its texts are read and its images decoded)."""
        with self._queue_lock:
            if self._queued[tenant] >= self.settings.max_queued:
                raise RequestError(
                    429,
                    f"{self._queued[tenant]} requests of this tenant are in the server; retry shortly",
                    code="rate_limit_exceeded",
                )
            self._queued[tenant] += 1
        try:
            yield
        finally:
            with self._queue_lock:
                self._queued[tenant] -= 1
                if self._queued[tenant] <= 0:
                    del self._queued[tenant]

    def _window(self, tenant: str, system: str | None, config: WindowConfig) -> KameraWindow:
        """A conversation window of ``tenant``, its chunks keyed in the tenant's namespace."""
        return KameraWindow(
            self.backend,
            config=config,
            store=self.store,
            conversation=True,
            system_prompt=system,
            cache_salt=self.settings.cache_salt(tenant),
        )

    def _gauges(self) -> dict[str, float]:
        stats = self.store.stats()
        remote = {"off": -1.0, "down": 0.0, "slow": 0.5, "up": 1.0}[stats.remote_state]
        return {
            "sessions": float(len(self.sessions)),
            "window_cache_bytes": float(self.sessions.cache_bytes),
            "store_memory_bytes": float(stats.memory_bytes),
            "store_disk_bytes": float(stats.disk_bytes),
            "store_entries": float(stats.memory_entries + stats.disk_entries),
            "store_remote_up": remote,
            "store_remote_bytes_written": float(stats.remote_bytes_written),
            "image_cache_bytes": float(self.images.nbytes),
            "message_cache_bytes": float(self.messages.nbytes),
            "anchor_cache_bytes": float(self.messages.anchor_nbytes),
            "image_bytes_in_flight": float(self.pixels.held),
            "decode_steps": float(self.turns.steps),
            "waiting_for_model": float(self.turns.waiting),
        }


def _freed(session: Session) -> Callable[[], bool]:
    return lambda: not session.busy


def _turn_taking(turn: Turn, clock: Clock, keep_going: KeepGoing) -> Callable[[], bool]:
    """Asked before each decode step: the model handed to whoever waits (the step's token is then
    picked: the first one's time is stamped), then whether the client still wants the answer."""

    def step() -> bool:
        turn.step()
        clock.stepped()
        return keep_going() if keep_going is not None else True

    return step
