"""``kamera serve [MODEL] [--host 127.0.0.1 --port 8000 --config FILE]``: run the server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

__all__ = ["add_serve_parser", "run_serve_command"]


def add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible chat server over kamera windows")
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a checkpoint folder or GGUF file (default: the shipped demo model)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (a file, or the template itself) replacing the model's own; a base "
        "model without one needs it",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--config", default=None, help='a WindowConfig as a JSON file (e.g. {"rank": "full"})')
    serve.add_argument(
        "--model-name", default=None, help="the id clients send as model (default: the folder name)"
    )
    serve.add_argument("--max-sessions", type=int, default=16, help="live conversation windows at most")
    serve.add_argument(
        "--idle-timeout", type=float, default=1800.0, help="seconds before an idle session is dropped"
    )
    serve.add_argument("--max-tokens", type=int, default=256, help="answer length when a request gives none")
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
    serve.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY)")
    serve.add_argument(
        "--api-keys",
        default=None,
        help='a JSON file of keys to tenant names ({"KEY": "tenant"}); each key a tenant',
    )
    serve.add_argument(
        "--max-request-bytes", type=int, default=32 << 20, help="the largest request body read (413 past it)"
    )
    serve.add_argument("--max-messages", type=int, default=1024, help="messages one request may carry")
    serve.add_argument(
        "--max-queued", type=int, default=8, help="requests of one tenant in the server at once (429 past it)"
    )
    _add_limit_arguments(serve)
    serve.add_argument(
        "--reuse",
        choices=["kamera", "prefix"],
        default="kamera",
        help="kamera: every edit the window can make; prefix: serve as a prefix cache would (keep the "
        "unchanged leading messages, prefill the rest exactly): the baseline to compare against",
    )


def run_serve_command(args: argparse.Namespace, console: Console) -> int:
    import uvicorn
    from rich.markup import escape

    from kamera_agent.errors import KameraError
    from kamera_agent.serve.app import create_app
    from kamera_agent.serve.listen import uvicorn_config

    try:
        server = build_server(args)
    except KameraError as exc:  # a model or settings it cannot serve: one line, not a traceback
        console.print(f"[red]kamera serve: refused — {escape(str(exc))}[/red]")
        return 2
    if server.settings.api_keys is None and args.host not in _LOOPBACK:
        console.print(
            f"[yellow]warning: listening on {args.host} with no API key: every client is one tenant and "
            "can read and steer every session; pass --api-key or --api-keys[/yellow]"
        )
    console.print(
        f"kamera serve: {server.settings.model_name} on http://{args.host}:{args.port}/v1 "
        f"(store: {server.store.remote or 'this process'})"
    )
    uvicorn.Server(uvicorn_config(create_app(server), server.settings, args.host, args.port)).run()
    return 0


def build_server(args: argparse.Namespace) -> Any:
    """The `KameraServer` the arguments describe (the model loaded, nothing listening yet)."""
    from kamera_agent.backends.base import Backend
    from kamera_agent.backends.transformers import TransformersBackend
    from kamera_agent.config import WindowConfig
    from kamera_agent.serve.media import ImageFetching
    from kamera_agent.serve.server import KameraServer, ServeSettings
    from kamera_agent.serve.turns import Limits
    from kamera_agent.window.setup import resolve_backend

    config = WindowConfig(**json.loads(Path(args.config).read_text())) if args.config else WindowConfig()
    backend: Backend
    template = _chat_template(args.chat_template)
    if args.model is None:
        from kamera_agent.demo.model import DEMO_MODEL_DIR, load_demo_model

        model, tokenizer, image_processor = load_demo_model()
        if template is not None:
            tokenizer.chat_template = template
        backend = TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)
        name = args.model_name or DEMO_MODEL_DIR.name
    else:
        backend = resolve_backend(args.model, None, None, None, config, chat_template=template)
        path = Path(args.model)
        name = args.model_name or (path.stem if path.suffix == ".gguf" else path.name)
    settings = ServeSettings(
        model_name=name,
        config=config,
        max_sessions=args.max_sessions,
        idle_seconds=args.idle_timeout,
        fetching=ImageFetching(enabled=args.fetch_images, allow_private=args.fetch_private_images),
        local_media=Path(args.allowed_local_media_path) if args.allowed_local_media_path else None,
        max_tokens=args.max_tokens,
        api_keys=_api_keys(args),
        limits=Limits(max_messages=args.max_messages),
        max_request_bytes=args.max_request_bytes,
        max_queued=args.max_queued,
        reuse=args.reuse,
        **_limits(args),
    )
    return KameraServer(backend, settings)


_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def _chat_template(given: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself where it is Jinja."""
    if given is None:
        return None
    path = Path(given)
    if path.is_file():
        return path.read_text()
    if "{{" in given or "{%" in given:
        return given
    raise SystemExit(f"--chat-template {given}: no such file, and not a Jinja template")


def _add_limit_arguments(serve: Any) -> None:
    """What one request or one peer may hold: time, the model, decoding memory."""
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


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    """The `ServeSettings` fields `_add_limit_arguments` sets."""
    return {
        "header_timeout": args.header_timeout,
        "max_concurrent": args.max_concurrent,
        "max_decode_tokens": args.max_decode_tokens,
        "image_bytes_in_flight": args.image_bytes_in_flight,
        "tenant_image_bytes_in_flight": args.tenant_image_bytes_in_flight,
    }


def _api_keys(args: argparse.Namespace) -> dict[str, str] | None:
    """Key → tenant from ``--api-key`` (the tenant ``"default"``) and ``--api-keys FILE``."""
    keys: dict[str, str] = {}
    if args.api_keys:
        loaded = json.loads(Path(args.api_keys).read_text())
        if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
            raise SystemExit(f'--api-keys {args.api_keys}: expected a JSON object {{"KEY": "tenant", ...}}')
        keys.update(loaded)
    if args.api_key:
        keys[args.api_key] = "default"
    return keys or None
