"""One model behind chat completions: requests become window edits, answers carry true usage.

Why a class apart from the HTTP app: everything that decides what a request costs (which
session, which ops, what was reused) is plain Python, testable without sockets, and runs under
one lock because the model runs one forward at a time. The app (`kamera_agent.serve.app`) only
moves bytes and streams.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError

from kamera_agent.backends.base import Backend
from kamera_agent.backends.decoding import decoded_tokens
from kamera_agent.config import WindowConfig
from kamera_agent.errors import ContextOverflowError, KameraError
from kamera_agent.results import Answer, OpCost
from kamera_agent.serve.metrics import Metrics
from kamera_agent.serve.protocol import ChatRequest, RequestError
from kamera_agent.serve.sessions import SessionPool
from kamera_agent.serve.sync import SyncReport, sync_window
from kamera_agent.serve.turns import ImageFetching, ImageReader, read_turns
from kamera_agent.store import ChunkStore
from kamera_agent.window import KameraWindow
from kamera_agent.window.setup import resolve_store

__all__ = ["Completion", "KameraServer", "ServeSettings"]

_STORE_FIELDS = {"memory_budget", "disk_dir", "disk_budget", "store_url"}
_FIDELITY_FIELDS = {"rank", "patch_mode", "orbit", "survivors", "reorder", "recall_context", "cascade"}


@dataclass(frozen=True)
class ServeSettings:
    """How the server runs.

    Attributes:
        model_name: the id clients send as ``model``.
        config: every session's `WindowConfig` (its store fields build the one shared store).
        max_sessions: live windows at most (least recently used dropped first).
        idle_seconds: a window unused this long is dropped.
        fetching: whether ``http(s)`` image URLs are fetched.
        max_tokens: answer length when a request gives none.
    """

    model_name: str
    config: WindowConfig
    max_sessions: int = 16
    idle_seconds: float = 1800.0
    fetching: ImageFetching = field(default_factory=ImageFetching)
    max_tokens: int = 256


@dataclass(frozen=True)
class Completion:
    """A served request: the answer, its session, what it did and its usage."""

    id: str
    created: int
    model: str
    session_id: str
    answer: Answer
    report: SyncReport
    prompt_tokens: int
    cached_tokens: int

    @property
    def finish_reason(self) -> str:
        return "length" if self.answer.finish_reason == "length" else "stop"

    def usage(self) -> dict[str, Any]:
        completion = len(self.answer.tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def kamera(self) -> dict[str, Any]:
        """The extension object: the session, every op the request ran and what each cost."""
        ops = [
            {"op": op, "chunks": labels, **_cost(cost)}
            for op, labels, cost in [*self.report.ops, ("ask", [], self.answer.cost or OpCost())]
        ]
        return {
            "session_id": self.session_id,
            "ops": ops,
            "prefilled_prompt_tokens": self.prompt_tokens - self.cached_tokens,
        }


class KameraServer:
    """Sessions of conversation windows over one backend and one shared store."""

    def __init__(self, backend: Backend, settings: ServeSettings) -> None:
        self.backend, self.settings = backend, settings
        self.store: ChunkStore = resolve_store(backend, settings.config, None)
        self.images = ImageReader(settings.fetching, max_pixels=settings.config.max_image_pixels)
        self.sessions = SessionPool(self._window, settings.max_sessions, settings.idle_seconds)
        self.metrics = Metrics(self._gauges)
        self._lock = threading.Lock()
        self._configs: dict[str, WindowConfig] = {}

    def complete(self, request: ChatRequest, on_text: Callable[[str], None] | None = None) -> Completion:
        """Serve one request (streaming through ``on_text`` when given).

        Raises:
            RequestError: anything the request asks that cannot be served (4xx).
        """
        request.refuse_unsupported()
        if request.model != self.settings.model_name:
            raise RequestError(
                404,
                f"model {request.model!r} is not served here; it serves {self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )
        system, turns = read_turns(request.messages, self.images)
        settings = self._settings_key(request.kamera)
        digests = [turn.digest for turn in turns]
        with self._lock:
            session = self.sessions.session_for(request.session_id or request.user, system, settings, digests)
            window = session.window
            try:
                report = sync_window(window, turns)
                answer = window.ask(
                    report.query,
                    in_message=report.in_message,
                    max_new_tokens=request.answer_tokens or self.settings.max_tokens,
                    temperature=request.temperature,
                    top_p=request.top_p,
                    seed=request.seed,
                    stop=request.stops,
                    on_text=on_text,
                )
            except ContextOverflowError as exc:
                raise RequestError(400, str(exc), param="messages", code="context_length_exceeded") from exc
            except KameraError as exc:
                raise RequestError(400, str(exc), param="messages") from exc
            session.digests = digests
        query_tokens = int(window.query_ids(report.query, in_message=report.in_message).shape[0])
        prompt = report.prompt_tokens + query_tokens
        ask = answer.cost or OpCost()
        prefilled = report.cost.tokens_prefilled + ask.tokens_prefilled - decoded_tokens(answer)
        cached = max(0, prompt - prefilled)
        ops = [(op, cost) for op, _, cost in report.ops] + [("ask", ask)]
        self.metrics.served(prompt, cached, len(answer.tokens), ops)
        return Completion(
            f"chatcmpl-{uuid.uuid4().hex[:24]}",
            int(time.time()),
            self.settings.model_name,
            session.id,
            answer,
            report,
            prompt,
            cached,
        )

    def _settings_key(self, overrides: dict[str, Any] | None) -> str:
        config = self._config_for(overrides or {})
        key = config.model_dump_json()
        self._configs[key] = config
        return key

    def _config_for(self, overrides: dict[str, Any]) -> WindowConfig:
        fields = dict(overrides)
        preset = fields.pop("preset", None)
        bad = sorted(_STORE_FIELDS & set(fields))
        if bad:
            raise RequestError(
                400, f"{', '.join(bad)} configure the server's shared store, not a request", param="kamera"
            )
        base = self.settings.config.model_dump(exclude=_STORE_FIELDS, exclude_unset=True)
        try:
            if preset == "exact":
                kept = {k: v for k, v in base.items() if k not in _FIDELITY_FIELDS}
                return WindowConfig.exact(**{**kept, **fields})
            if preset is not None:
                raise RequestError(400, f"unknown preset {preset!r}; known: exact", param="kamera")
            return WindowConfig(**{**base, **fields})
        except ValidationError as exc:
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
        }


def _cost(cost: OpCost) -> dict[str, Any]:
    """Every `OpCost` field, seconds rounded to the microsecond."""
    return {**asdict(cost), "seconds": round(cost.seconds, 6)}
