"""``kamera serve``: its arguments (`kamera_agent.serve.command` builds the server from them)."""

from __future__ import annotations

from typing import Any

from kamera_agent.parsers import add_chat_template, add_command

__all__ = ["LOG_LEVELS", "add_serve_parser"]

LOG_LEVELS = ("debug", "info", "warning", "error")
"""``--log-level`` choices: ``info`` writes the access log, ``warning`` only faults and refusals."""


def add_serve_parser(commands: Any) -> None:
    """Register ``serve``."""
    serve = add_command(
        commands,
        "serve",
        "an OpenAI-compatible chat server over kamera windows",
        "Serve a model with OpenAI's chat completions and Responses APIs: each request's messages "
        "become one edit of its conversation's window (kept, moved, evicted, recalled, new), and "
        "usage says what was reused. Tenants by API key, an access log, Prometheus metrics at "
        "/metrics (docs/serve.md).",
    )
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a checkpoint folder or GGUF file (default: the shipped demo model)",
    )
    add_chat_template(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--config", default=None, help='a WindowConfig as a JSON file (e.g. {"rank": "full"})')
    serve.add_argument(
        "--model-name", default=None, help="the id clients send as model (default: the folder name)"
    )
    serve.add_argument("--max-sessions", type=int, default=16, help="live conversation windows of one tenant")
    serve.add_argument(
        "--idle-timeout", type=float, default=1800.0, help="seconds before an idle session is dropped"
    )
    serve.add_argument("--max-tokens", type=int, default=256, help="answer length when a request gives none")
    serve.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="info: one access-log line a request"
    )
    _add_media_arguments(serve)
    _add_tenant_arguments(serve)
    _add_limit_arguments(serve)
    serve.add_argument(
        "--reuse",
        choices=["kamera", "prefix"],
        default="kamera",
        help="kamera: every edit the window can make; prefix: serve as a prefix cache would (keep the "
        "unchanged leading messages, prefill the rest exactly): the baseline to compare against",
    )


def _add_media_arguments(serve: Any) -> None:
    """Where image URLs may be read from."""
    serve.add_argument(
        "--fetch-images", action="store_true", help="fetch http(s) image URLs (off: data: URLs only)"
    )
    serve.add_argument(
        "--fetch-private-images",
        action="store_true",
        help="with --fetch-images: also fetch from private, loopback and link-local addresses",
    )
    serve.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="read file:// image URLs of regular files under this folder (off: none)",
    )


def _add_tenant_arguments(serve: Any) -> None:
    """Who may ask, and what tenants may share."""
    serve.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY)")
    serve.add_argument(
        "--api-keys",
        default=None,
        help='a JSON file of keys to tenant names ({"KEY": "tenant"}); each key a tenant',
    )
    serve.add_argument(
        "--share-content-across-tenants",
        action="store_true",
        help="reuse KV of identical content across tenants (off: each tenant's store entries are its own). "
        "A side channel: a tenant's cached_tokens then tell whether another tenant sent that content",
    )
    serve.add_argument(
        "--metrics-key",
        default=None,
        help="the key /metrics answers to (every tenant's traffic; tenants' keys then get 403). Without "
        "it, with several tenants, /metrics answers to no tenant's key",
    )


def _add_limit_arguments(serve: Any) -> None:
    """What one request or one peer may hold: time, size, the model, decoding memory."""
    serve.add_argument(
        "--max-request-bytes", type=int, default=32 << 20, help="the largest request body read (413 past it)"
    )
    serve.add_argument("--max-messages", type=int, default=1024, help="messages one request may carry")
    serve.add_argument(
        "--max-queued", type=int, default=8, help="requests of one tenant in the server at once (429 past it)"
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection has to send a request's headers (later: 408, closed)",
    )
    serve.add_argument(
        "--max-concurrent",
        type=int,
        default=256,
        help="requests in the server at once, all tenants together (503 past it; /health never)",
    )
    serve.add_argument(
        "--max-decode-tokens",
        type=int,
        default=16384,
        help="n x max_tokens one request may ask for (400 past it)",
    )
    serve.add_argument(
        "--window-cache-bytes",
        type=int,
        default=2 << 30,
        help="engine caches live windows keep between requests, all tenants together "
        "(past it, the least recently used idle windows release theirs)",
    )
    serve.add_argument(
        "--image-bytes-in-flight",
        type=int,
        default=2 << 30,
        help="memory of images being decoded at once, all tenants together (429 past it)",
    )
    serve.add_argument(
        "--tenant-image-bytes-in-flight",
        type=int,
        default=1 << 30,
        help="memory of one tenant's images being decoded at once (429 past it)",
    )
