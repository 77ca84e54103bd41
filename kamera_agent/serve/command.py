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
        "model", nargs="?", default=None, help="a local checkpoint (default: the shipped demo model)"
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
        "--fetch-images", action="store_true", help="fetch http(s) image URLs (off: data: and file:// only)"
    )


def run_serve_command(args: argparse.Namespace, console: Console) -> int:
    import uvicorn

    from kamera_agent.serve.app import create_app

    server = build_server(args)
    console.print(
        f"kamera serve: {server.settings.model_name} on http://{args.host}:{args.port}/v1 "
        f"(store: {server.store.remote or 'this process'})"
    )
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="warning")
    return 0


def build_server(args: argparse.Namespace) -> Any:
    """The `KameraServer` the arguments describe (the model loaded, nothing listening yet)."""
    from kamera_agent.backends.base import Backend
    from kamera_agent.backends.transformers import TransformersBackend
    from kamera_agent.config import WindowConfig
    from kamera_agent.serve.server import KameraServer, ServeSettings
    from kamera_agent.serve.turns import ImageFetching
    from kamera_agent.window.setup import resolve_backend

    config = WindowConfig(**json.loads(Path(args.config).read_text())) if args.config else WindowConfig()
    backend: Backend
    if args.model is None:
        from kamera_agent.demo.model import DEMO_MODEL_DIR, load_demo_model

        model, tokenizer, image_processor = load_demo_model()
        backend = TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)
        name = args.model_name or DEMO_MODEL_DIR.name
    else:
        backend = resolve_backend(args.model, None, None, None, config)
        name = args.model_name or Path(args.model).name
    settings = ServeSettings(
        model_name=name,
        config=config,
        max_sessions=args.max_sessions,
        idle_seconds=args.idle_timeout,
        fetching=ImageFetching(enabled=args.fetch_images),
        max_tokens=args.max_tokens,
    )
    return KameraServer(backend, settings)
