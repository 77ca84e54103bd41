"""One model behind chat completions: requests become window edits, answers carry true usage.

Why a class apart from the HTTP app: everything that decides what a request costs (which
tenant and session, which ops, what was reused) is plain Python, testable without sockets.
The model runs one forward at a time, so the window edit and the answer run under one lock;
everything else a request needs (validating it, fetching and decoding its new images,
tokenizing and hashing its new messages, checking its question fits) runs before it, outside
the lock, and a tenant may have only so many requests waiting for it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kamera_agent.backends.base import Backend, Constraint
from kamera_agent.backends.decoding import decoded_tokens
from kamera_agent.config import WindowConfig
from kamera_agent.errors import ConfigError, ContextOverflowError, KameraError
from kamera_agent.results import Answer, OpCost
from kamera_agent.serve.completion import Completion, called
from kamera_agent.serve.fetch import ImageFetching
from kamera_agent.serve.media import MediaPolicy
from kamera_agent.serve.messages import MessageChunks, Prepared
from kamera_agent.serve.metrics import Metrics
from kamera_agent.serve.protocol import ChatRequest, RequestError
from kamera_agent.serve.responses import ResponseStore
from kamera_agent.serve.sessions import SessionPool
from kamera_agent.serve.structured import json_constraint, tool_call_constraint
from kamera_agent.serve.sync import sync_window
from kamera_agent.serve.tools import CallFilter, ToolFormat, system_with_tools, tool_format_for
from kamera_agent.serve.turns import ImageReader, Limits, read_turns
from kamera_agent.store import ChunkStore
from kamera_agent.window import KameraWindow
from kamera_agent.window.setup import resolve_store

__all__ = ["DEFAULT_TENANT", "Completion", "KameraServer", "ServeSettings"]

DEFAULT_TENANT = "default"
"""The one tenant every client is when the server has no API keys."""
FIDELITY_FIELDS = frozenset(
    {"rank", "patch_mode", "orbit", "survivors", "reorder", "recall_context", "cascade", "drift_budget"}
)
"""The `WindowConfig` fields a request may set for its own session (``kamera``): how faithful
its window is. Anything process-wide (threads, device, dtype, store, budgets) is the server's."""
_MAX_CONFIGS = 64
_STORE_FIELDS = {
    "memory_budget",
    "disk_dir",
    "disk_budget",
    "store_url",
    "store_secret",
    "store_previous_secrets",
}  # the one shared store's


@dataclass(frozen=True)
class ServeSettings:
    """How the server runs.

    Attributes:
        model_name: the id clients send as ``model``.
        config: every session's `WindowConfig` (its store fields build the one shared store).
        max_sessions: live windows of one tenant at most (its least recently used dropped first).
        idle_seconds: a window unused this long is dropped.
        fetching: whether and how ``http(s)`` image URLs are fetched.
        local_media: the folder ``file://`` image URLs may name files under (``None``: no
            ``file://`` URL is read).
        max_tokens: answer length when a request gives none.
        api_keys: API key → tenant name; ``None``: no key is asked and every client is one tenant.
        limits: messages and parts one request may carry.
        max_request_bytes: the largest request body read (larger: 413, not read whole).
        read_timeout: seconds a client has to send its whole body (slower: 408).
        max_queued: requests of one tenant in the server at once (more: 429 with Retry-After).
        image_cache_bytes: decoded images kept, in bytes.
        chunk_cache_bytes: prepared messages (tokens, preprocessed pixels) kept, in bytes.
        reuse: ``"kamera"`` (every edit the window can make) or ``"prefix"``: the same server
            as a prefix cache (vLLM's and SGLang's reuse): each request keeps its window's
            unchanged leading messages and prefills everything from the first change, exactly
            (`WindowConfig.exact`); the baseline a comparison runs beside kamera.
    """

    model_name: str
    config: WindowConfig
    max_sessions: int = 16
    idle_seconds: float = 1800.0
    fetching: ImageFetching = field(default_factory=ImageFetching)
    local_media: Path | None = None
    max_tokens: int = 256
    api_keys: Mapping[str, str] | None = None
    limits: Limits = field(default_factory=Limits)
    max_request_bytes: int = 32 << 20
    read_timeout: float = 30.0
    max_queued: int = 8
    image_cache_bytes: int = 64 << 20
    chunk_cache_bytes: int = 128 << 20
    reuse: str = "kamera"

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant an ``Authorization`` header names (``None``: not a key of this server)."""
        if self.api_keys is None:
            return DEFAULT_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        return self.api_keys.get(key.strip()) if scheme.lower() == "bearer" else None


@dataclass(frozen=True)
class _Asked:
    """A request read and prepared outside the lock: what answering it under the lock needs."""

    request: ChatRequest
    tenant: str
    settings: str
    system: str | None
    digests: list[str]
    prepared: Prepared
    query_tokens: int
    constraint: Callable[[], Constraint] | None = None


class KameraServer:
    """Sessions of conversation windows over one backend and one shared store, by tenant."""

    def __init__(self, backend: Backend, settings: ServeSettings) -> None:
        if settings.reuse not in ("kamera", "prefix"):
            raise ConfigError(f"reuse {settings.reuse!r}: 'kamera' or 'prefix' (a prefix cache)")
        self.backend, self.settings = backend, settings
        self.store: ChunkStore = resolve_store(backend, settings.config, None)
        policy = MediaPolicy(settings.fetching, settings.local_media)
        max_pixels = settings.config.max_image_pixels
        self.images = ImageReader(policy, max_pixels=max_pixels, budget=settings.image_cache_bytes)
        self.messages = MessageChunks(backend, self.images, settings.chunk_cache_bytes, max_pixels)
        self.sessions = SessionPool(self._window, settings.max_sessions, settings.idle_seconds)
        self.metrics = Metrics(self._gauges)
        self._lock = threading.Lock()
        self._configs: OrderedDict[str, WindowConfig] = OrderedDict()
        self._queued: Counter[str] = Counter()
        self._queue_lock = threading.Lock()
        self._llg_tokenizer: Any = None
        self.responses = ResponseStore()
        """Stored responses (``/v1/responses``), per tenant bounded."""
        self.tool_format: ToolFormat = tool_format_for(backend.encoder.tokenizer)
        """How the model's template writes tool calls (rendered history, parsed answers, grammar)."""

    def complete(
        self,
        request: ChatRequest,
        *,
        tenant: str = DEFAULT_TENANT,
        on_text: Callable[[str], None] | None = None,
        keep_going: Callable[[], bool] | None = None,
    ) -> Completion:
        """Serve one request of ``tenant`` (streaming through ``on_text`` when given; ended
        early when ``keep_going`` says so: the client went away).

        Raises:
            RequestError: anything the request asks that cannot be served (4xx), or 429 when the
                tenant already has ``max_queued`` requests in the server.
        """
        request.refuse_unsupported()
        if request.model != self.settings.model_name:
            raise RequestError(
                404,
                f"model {request.model!r} is not served here; it serves {self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )
        settings = self._settings_key(request.kamera)
        system, turns = read_turns(request.messages, self.settings.limits, self.tool_format)
        if request.tools:  # the definitions belong to the system block: the conversation's anchor
            system = system_with_tools(
                self.backend.encoder.tokenizer, self.messages.template, system, request.tools
            )
        constraint = self._constraint(request)
        prepared = self.messages.prepare(system, turns)  # images, tokens, keys: outside the lock
        query_tokens = self._query_tokens(system, prepared)
        with self._admitted(tenant):
            digests = [turn.digest for turn in turns]
            asked = _Asked(request, tenant, settings, system, digests, prepared, query_tokens, constraint)
            return self._answer(asked, on_text, keep_going)

    def _answer(
        self, asked: _Asked, on_text: Callable[[str], None] | None, keep_going: Callable[[], bool] | None
    ) -> Completion:
        request, prepared = asked.request, asked.prepared
        calls = CallFilter(on_text, self.tool_format) if on_text is not None and request.calls_tools else None
        if calls is not None:
            on_text = calls  # a call is sent as tool_calls, never as text
        with self._lock:
            session = self.sessions.session_for(
                asked.tenant, request.pinned, asked.system, asked.settings, asked.digests
            )
            window = session.window
            try:
                report = sync_window(window, prepared, prefix_only=self.settings.reuse == "prefix")
                answers = []
                for choice in range(request.n):  # n samples over one prefill of the prompt
                    answers.append(
                        window.ask(
                            report.query,
                            in_message=report.in_message,
                            query_role=prepared.role,
                            max_new_tokens=request.answer_tokens or self.settings.max_tokens,
                            temperature=request.temperature,
                            top_p=request.top_p,
                            seed=None if request.seed is None else (request.seed + choice) % (1 << 63),
                            stop=request.stops,
                            on_text=on_text,
                            keep_going=keep_going,
                            logit_bias=request.token_bias,
                            presence_penalty=request.presence_penalty,
                            frequency_penalty=request.frequency_penalty,
                            top_logprobs=(request.top_logprobs or 0) if request.logprobs else None,
                            constraint=asked.constraint,
                        )
                    )
                answer = answers[0]
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
        asks = [each.cost or OpCost() for each in answers]
        spent = report.cost.tokens_prefilled + sum(
            cost.tokens_prefilled - decoded_tokens(each) for cost, each in zip(asks, answers, strict=True)
        )
        done = Completion(
            f"chatcmpl-{uuid.uuid4().hex[:24]}",
            int(time.time()),
            self.settings.model_name,
            session.id,
            answer,
            report,
            split,
            spent,
            tuple(answers[1:]),
            tuple(self._logprobs(each) for each in answers),
            tuple(called(each, request.parallel_tool_calls, self.tool_format) for each in answers)
            if request.calls_tools
            else (),
            drift,
        )
        if calls is not None:
            calls.flush(done.calls[0].content)
        ops = [(op, cost) for op, _, cost in report.ops] + [("ask", cost) for cost in asks]
        self.metrics.served(done.usage(), split, spent, ops, cancelled=answer.finish_reason == "cancelled")
        return done

    def _constraint(self, request: ChatRequest) -> Callable[[], Constraint] | None:
        """What the answer's tokens are held to: a required tool call, a JSON format, or nothing."""
        forced = request.forced_tools
        if forced is not None:
            return tool_call_constraint(
                self._grammar_tokenizer(), forced, self.tool_format, parallel=request.parallel_tool_calls
            )
        if (request.response_format or {}).get("type", "text") != "text":
            return json_constraint(self._grammar_tokenizer(), request.response_format or {})
        return None

    def _grammar_tokenizer(self) -> Any:
        """The served tokenizer as llguidance reads it (built on first use: structured output)."""
        if self._llg_tokenizer is None:
            import llguidance.hf

            self._llg_tokenizer = llguidance.hf.from_tokenizer(self.backend.encoder.tokenizer)
        return self._llg_tokenizer

    def _logprobs(self, answer: Answer) -> dict[str, Any] | None:
        """An answer's ``logprobs`` in OpenAI's shape (each token's text, logprob, UTF-8 bytes
        and its step's most likely alternatives), or ``None`` when not asked for."""
        if answer.logprobs is None:
            return None
        tokenizer = self.backend.encoder.tokenizer

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(step.token, step.logprob), "top_logprobs": [entry(t, lp) for t, lp in step.top]}
                for step in answer.logprobs
            ],
            "refusal": None,
        }

    def _query_tokens(self, system: str | None, prepared: Prepared) -> int:
        """The question's tokens (tokenized once, before the lock), refusing a question that alone
        cannot fit the model's context (its tokenizing would hold the lock for a text no answer
        can follow)."""
        conversation = self.messages.conversation(system)
        ids = conversation.query_ids(prepared.query, opened=not prepared.in_message, role=prepared.role)
        tokens = int(ids.shape[0])
        limit = self.backend.context_limit
        if limit is not None and tokens >= limit:
            raise RequestError(
                400,
                f"the question alone is {tokens} tokens; the model has {limit}: shorten it",
                param="messages",
                code="context_length_exceeded",
            )
        return tokens

    @contextmanager
    def _admitted(self, tenant: str) -> Iterator[None]:
        """A place for one more request of ``tenant`` while it runs, or 429 when it has
        ``max_queued`` already (they would only wait for the model's lock, holding threads)."""
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

    def _settings_key(self, overrides: dict[str, Any] | None) -> str:
        config = self._config_for(overrides or {})
        key = config.model_dump_json()
        with self._queue_lock:
            self._configs[key] = config
            self._configs.move_to_end(key)
            while len(self._configs) > _MAX_CONFIGS:
                self._configs.popitem(last=False)
        return key

    def _config_for(self, overrides: dict[str, Any]) -> WindowConfig:
        fields = dict(overrides)
        preset = fields.pop("preset", None)
        if self.settings.reuse == "prefix":  # a prefix cache is exact: nothing to tune per request
            if fields or preset not in (None, "exact"):
                name = sorted(fields)[0] if fields else "preset"
                raise RequestError(
                    400,
                    f"kamera.{name}: this server reuses only a prefix (reuse 'prefix'), every answer "
                    "exact; send no fidelity settings",
                    param=f"kamera.{name}",
                )
            preset = "exact"
        refused = sorted(set(fields) - FIDELITY_FIELDS)
        if refused:
            raise RequestError(
                400,
                f"kamera.{refused[0]} is not a per-request setting: a request may set "
                f"{', '.join(sorted(FIDELITY_FIELDS))} or preset; the rest is the server's (--config)",
                param=f"kamera.{refused[0]}",
            )
        base = self.settings.config.model_dump(exclude=_STORE_FIELDS, exclude_unset=True)
        try:
            if preset == "exact":
                kept = {k: v for k, v in base.items() if k not in FIDELITY_FIELDS}
                return WindowConfig.exact(**{**kept, **fields})
            if preset is not None:
                raise RequestError(
                    400, f"unknown preset {str(preset)[:40]!r}; known: exact", param="kamera.preset"
                )
            return WindowConfig(**{**base, **fields})
        except (ValidationError, ConfigError) as exc:
            raise RequestError(400, f"bad kamera settings: {exc.errors()[0]['msg']}", param="kamera") from exc

    def _window(self, system: str | None, settings: str) -> KameraWindow:
        return KameraWindow(
            self.backend,
            config=self._configs[settings],
            store=self.store,
            conversation=True,
            system_prompt=system,
        )

    def _gauges(self) -> dict[str, float]:
        stats = self.store.stats()
        remote = {"off": -1.0, "down": 0.0, "up": 1.0}[stats.remote_state]
        return {
            "sessions": float(len(self.sessions)),
            "store_memory_bytes": float(stats.memory_bytes),
            "store_disk_bytes": float(stats.disk_bytes),
            "store_entries": float(stats.memory_entries + stats.disk_entries),
            "store_remote_up": remote,
            "store_remote_bytes_written": float(stats.remote_bytes_written),
            "image_cache_bytes": float(self.images.nbytes),
            "message_cache_bytes": float(self.messages.nbytes),
        }
