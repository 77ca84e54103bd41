"""``kamera serve [MODEL] [--host 127.0.0.1 --port 8000 --config FILE]``: run the server.

Its arguments are declared in `kamera_agent.parsers.serve` (``kamera serve --help`` needs no
torch); this builds the server from them. Everything it cannot take (a ``--config`` file that
is missing, not JSON or not a `WindowConfig`; a key file or chat template it cannot read; a
model it cannot serve) is a `KameraError` the ``kamera`` command prints in one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from rich.console import Console

from kamera_agent.errors import SettingsError
from kamera_agent.parsers.serve import add_serve_parser

__all__ = [
    "add_serve_parser",
    "build_server",
    "is_inline_template",
    "read_chat_template",
    "run_serve_command",
]

_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def run_serve_command(args: argparse.Namespace, console: Console) -> int:
    """Build the server, then listen until interrupted.

    Raises:
        KameraError: a model or setting it cannot serve (before anything listens).
    """
    import uvicorn

    from kamera_agent.serve.app import create_app
    from kamera_agent.serve.listen import uvicorn_config

    server = build_server(args)
    if server.settings.api_keys is None and args.host not in _LOOPBACK:
        console.print(
            f"[yellow]warning: listening on {args.host} with no API key: every client is one tenant and "
            "can read and steer every session; pass --api-key or --api-keys[/yellow]"
        )
    console.print(
        f"kamera serve: {server.settings.model_name} on http://{args.host}:{args.port}/v1 "
        f"(store: {', '.join(server.store.shared) or 'this process'})"
    )
    configure_logging(args.log_level)
    config = uvicorn_config(create_app(server), server.settings, args.host, args.port, args.log_level)
    uvicorn.Server(config).run()
    return 0


def configure_logging(level: str) -> None:
    """kamera's log lines (the access log at ``info``, faults with their tracebacks at
    ``error``) to stderr, each with its time, level and logger."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("kamera_agent")
    logger.handlers = [handler]
    logger.setLevel(level.upper())


def build_server(args: argparse.Namespace) -> Any:
    """The `KameraServer` the arguments describe (the model loaded, nothing listening yet).

    Raises:
        SettingsError: a ``--config``, ``--api-keys`` or ``--chat-template`` it cannot read.
        KameraError: a model it cannot serve (`CheckpointError`, `UnsupportedModelError`, ...).
    """
    from kamera_agent.backends.base import Backend
    from kamera_agent.backends.transformers import TransformersBackend
    from kamera_agent.serve.media import ImageFetching
    from kamera_agent.serve.server import KameraServer, ServeSettings
    from kamera_agent.serve.turns import Limits
    from kamera_agent.window.setup import resolve_backend

    config = window_config(args.config)
    backend: Backend
    template = read_chat_template(args.chat_template)
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
        share_content=args.share_content_across_tenants,
        metrics_key=args.metrics_key,
        limits=Limits(max_messages=args.max_messages),
        max_request_bytes=args.max_request_bytes,
        max_queued=args.max_queued,
        reuse=args.reuse,
        **_limits(args),
    )
    return KameraServer(backend, settings)


def window_config(path: str | None) -> Any:
    """``--config``: the `WindowConfig` a JSON file holds (the defaults without one).

    Raises:
        SettingsError: the file is missing or unreadable, or not a JSON object.
        ConfigError: a value `WindowConfig` refuses (it names the field).
    """
    from kamera_agent.config import WindowConfig

    if path is None:
        return WindowConfig()
    fields = _json_file(path, "--config", 'a WindowConfig as a JSON object, e.g. {"rank": "full"}')
    if not isinstance(fields, dict):
        raise SettingsError(
            f'--config {path}: expected a JSON object of WindowConfig fields, e.g. {{"rank": 32}}'
        )
    return WindowConfig(**fields)


def _json_file(path: str, flag: str, what: str) -> Any:
    """The JSON a file given to ``flag`` holds, or a `SettingsError` naming the file and the fix."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError as exc:
        raise SettingsError(f"{flag} {path}: no such file; pass {what}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{flag} {path}: cannot be read ({type(exc).__name__}); pass {what}") from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SettingsError(f"{flag} {path}: not JSON ({exc}); pass {what}") from exc


def read_chat_template(given: str | None) -> str | None:
    """``--chat-template`` (of ``serve`` and ``bench``): a file's text, or the template itself where
    it is Jinja.

    Raises:
        SettingsError: neither a file nor a Jinja template.
    """
    if given is None:
        return None
    if is_inline_template(given):  # first: a long template is no file name (stat refuses it)
        return given
    path = Path(given)
    if path.is_file():
        return path.read_text()
    raise SettingsError(f"--chat-template {given}: no such file, and not a Jinja template; pass either")


def is_inline_template(given: str) -> bool:
    """Whether a ``--chat-template`` value is the Jinja template itself rather than a file."""
    return "{{" in given or "{%" in given


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    """The `ServeSettings` fields of the limit arguments (`kamera_agent.parsers.serve`)."""
    return {
        "header_timeout": args.header_timeout,
        "max_concurrent": args.max_concurrent,
        "max_decode_tokens": args.max_decode_tokens,
        "window_cache_bytes": args.window_cache_bytes,
        "image_bytes_in_flight": args.image_bytes_in_flight,
        "tenant_image_bytes_in_flight": args.tenant_image_bytes_in_flight,
    }


def _api_keys(args: argparse.Namespace) -> dict[str, str] | None:
    """Key → tenant from ``--api-key`` (the tenant ``"default"``) and ``--api-keys FILE``.

    Raises:
        SettingsError: a key file that is missing, not JSON or not ``{"KEY": "tenant", ...}``.
    """
    keys: dict[str, str] = {}
    if args.api_keys:
        shape = 'a JSON object {"KEY": "tenant", ...}'
        loaded = _json_file(args.api_keys, "--api-keys", shape)
        if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
            raise SettingsError(f"--api-keys {args.api_keys}: expected {shape}")
        keys.update(loaded)
    if args.api_key:
        keys[args.api_key] = "default"
    return keys or None
