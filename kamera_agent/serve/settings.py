"""How ``kamera serve`` runs: one frozen settings object, every limit a stranger meets in it.

Why one object: what the server refuses is decided here, in one place an operator reads (and the
CLI fills from its flags): how much a request may carry, how long a peer may take, how much of
the model and of memory one request or one tenant may hold.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kamera_agent.config import WindowConfig
from kamera_agent.errors import SettingsError
from kamera_agent.serve.bounds import SchemaBound
from kamera_agent.serve.fetch import ImageFetching
from kamera_agent.serve.protocol import RequestError
from kamera_agent.serve.turns import Limits

__all__ = ["DEFAULT_TENANT", "ServeSettings"]

DEFAULT_TENANT = "default"
"""The one tenant every client is when the server has no API keys."""


@dataclass(frozen=True)
class ServeSettings:
    """How the server runs.

    Attributes:
        model_name: the id clients send as ``model``.
        config: every session's `WindowConfig` (its store fields build the one shared store).
        max_sessions: live windows of one tenant at most (its least recently used dropped first).
        window_cache_bytes: the engine caches live windows keep for their next answers, every
            tenant's together (the assembled KV with its spare capacity): past it after a
            request, the least recently used idle windows release theirs (`SessionPool.bound_caches`).
        idle_seconds: a window unused this long is dropped.
        fetching: whether and how ``http(s)`` image URLs are fetched.
        local_media: the folder ``file://`` image URLs may name files under (``None``: no
            ``file://`` URL is read).
        max_tokens: answer length when a request gives none.
        api_keys: API key → tenant name; ``None``: no key is asked and every client is one tenant.
        share_content: key every tenant's store entries in one namespace, so a tenant's request
            reuses KV another tenant's requests made. Off (the default), each tenant's entries
            are its own: sharing is a membership side channel (a request's ``cached_tokens`` tell
            whether another tenant sent the same system prompt, messages or image).
        metrics_key: the key ``/metrics`` answers to (it reports every tenant's traffic).
            ``None``: a tenant's key, while the server has one tenant; with several, none.
        limits: messages and parts one request may carry.
        max_request_bytes: the largest request body read (larger: 413, not read whole).
        read_timeout: seconds a client has to send its whole body once its headers are in
            (slower: 408).
        header_timeout: seconds a connection has to send a request's headers (slower: closed).
        max_concurrent: requests in the server at once, every tenant's together (more: 503
            with Retry-After; ``/health`` is never refused).
        max_queued: requests of one tenant in the server at once (more: 429 with Retry-After).
        max_decode_tokens: ``n × max_tokens`` one request may ask for (more: 400).
        image_bytes_in_flight: working memory of images being decoded and preprocessed, every
            tenant's together (`kamera_agent.serve.pixels`; more: 429).
        tenant_image_bytes_in_flight: the same for one tenant.
        image_cache_bytes: decoded images kept, in bytes.
        chunk_cache_bytes: prepared messages (tokens, preprocessed pixels) kept, in bytes.
        anchor_cache_bytes: conversation framings (each system prompt's anchor) kept, in bytes.
        schema: how large a structured-output or forced-tool schema may be before compiling.
        reuse: ``"kamera"`` (every edit the window can make) or ``"prefix"``: the same server
            as a prefix cache (vLLM's and SGLang's reuse): each request keeps its window's
            unchanged leading messages and prefills everything from the first change, exactly
            (`WindowConfig.exact`); the baseline a comparison runs beside kamera.
    """

    model_name: str
    config: WindowConfig
    max_sessions: int = 16
    window_cache_bytes: int = 2 << 30
    idle_seconds: float = 1800.0
    fetching: ImageFetching = field(default_factory=ImageFetching)
    local_media: Path | None = None
    max_tokens: int = 256
    api_keys: Mapping[str, str] | None = None
    share_content: bool = False
    metrics_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_request_bytes: int = 32 << 20
    read_timeout: float = 30.0
    header_timeout: float = 10.0
    max_concurrent: int = 256
    max_queued: int = 8
    max_decode_tokens: int = 16384
    image_bytes_in_flight: int = 2 << 30
    tenant_image_bytes_in_flight: int = 1 << 30
    image_cache_bytes: int = 64 << 20
    chunk_cache_bytes: int = 128 << 20
    anchor_cache_bytes: int = 16 << 20
    schema: SchemaBound = field(default_factory=SchemaBound)
    reuse: str = "kamera"

    def __post_init__(self) -> None:
        """An empty key would let in whoever sends ``Authorization: Bearer`` with none; a
        negative byte limit bounds nothing."""
        if self.metrics_key == "" or (self.api_keys is not None and "" in self.api_keys):
            raise SettingsError(
                "an API key or metrics key is empty: it would admit anyone; give each a value"
            )
        if self.window_cache_bytes < 0:
            raise SettingsError(
                f"window_cache_bytes {self.window_cache_bytes}: a byte count, 0 or more "
                "(0: windows keep no engine cache between requests)"
            )

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant an ``Authorization`` header names (``None``: not a key of this server)."""
        if self.api_keys is None:
            return DEFAULT_TENANT
        key = _bearer(authorization)
        return None if key is None else self.api_keys.get(key)

    def cache_salt(self, tenant: str) -> str | None:
        """The namespace ``tenant``'s windows key their chunks in (`KameraWindow`'s ``cache_salt``):
        its own when the server has tenants and shares no content; ``None`` (unsalted) when every
        client is one tenant, or content is shared."""
        if self.api_keys is None or self.share_content:
            return None
        return f"kamera-serve/{tenant}"

    def refusal(self, path: str, authorization: str | None) -> RequestError | None:
        """Why a request for ``path`` with this ``Authorization`` header is refused (``None``: it
        is not). ``/health`` is open (a load balancer's probe); ``/metrics`` reports every
        tenant's traffic, so with several tenants it is the operator's (``metrics_key``)."""
        if path == "/metrics" and self.metrics_key is not None:
            given = _bearer(authorization) or ""
            if hmac.compare_digest(given.encode(), self.metrics_key.encode()):
                return None
            return _key_required("the metrics key")
        if path == "/health":
            return None
        if self.tenant_of(authorization) is None:
            return _key_required("a valid API key")
        if path == "/metrics" and self.api_keys is not None and len(set(self.api_keys.values())) > 1:
            return RequestError(
                403,
                "/metrics reports every tenant's traffic: the operator starts the server with "
                "--metrics-key KEY and scrapes with that key",
                code="metrics_key_required",
            )
        return None


def _bearer(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (``None``: no bearer key)."""
    scheme, _, key = (authorization or "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


def _key_required(what: str) -> RequestError:
    return RequestError(401, f"{what} is required: Authorization: Bearer <key>", code="invalid_api_key")
