"""A request's fidelity settings (``kamera``), made into the `WindowConfig` its session runs.

Why it travels with the request: the settings a request asked for are read once, at admission,
and carried to where its window is made. A table of recent settings looked up later let 70
requests with distinct settings push out one still waiting for the model (a 500 from a
``KeyError``, caused by other clients).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kamera_agent.config import FIDELITY_SETTINGS, STORE_FIELDS, WindowConfig
from kamera_agent.errors import ConfigError
from kamera_agent.serve.protocol import RequestError

__all__ = ["FIDELITY_FIELDS", "Fidelity", "fidelity_for"]

FIDELITY_FIELDS = frozenset(FIDELITY_SETTINGS)
"""The `WindowConfig` fields a request may set for its own session (``kamera``): how faithful
its window is. Anything process-wide (threads, device, dtype, store, byte limits) is the server's."""


@dataclass(frozen=True)
class Fidelity:
    """The settings a request's window runs: its config, and the key sessions are matched on
    (a session serves only requests that asked for the same)."""

    config: WindowConfig
    key: str


def fidelity_for(base: WindowConfig, overrides: dict[str, Any] | None, *, prefix_only: bool) -> Fidelity:
    """The settings ``overrides`` (a request's ``kamera`` object) ask for over the server's.

    Args:
        base: the server's `WindowConfig`.
        prefix_only: the server serves as a prefix cache: exact, nothing to tune.

    Raises:
        RequestError: 400 naming a field that is not a per-request setting, or a bad value.
    """
    fields = dict(overrides or {})
    preset = fields.pop("preset", None)
    if prefix_only:
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
    if preset not in (None, "exact"):
        raise RequestError(400, f"unknown preset {str(preset)[:40]!r}; known: exact", param="kamera.preset")
    config = _config(base, fields, exact=preset == "exact")
    return Fidelity(config, config.model_dump_json())


def _config(base: WindowConfig, fields: dict[str, Any], *, exact: bool) -> WindowConfig:
    given = base.model_dump(exclude=set(STORE_FIELDS), exclude_unset=True)
    try:
        if exact:
            others = {k: v for k, v in given.items() if k not in FIDELITY_FIELDS}
            return WindowConfig.exact(**{**others, **fields})
        return WindowConfig(**{**given, **fields})
    except (ValidationError, ConfigError) as exc:
        raise RequestError(400, f"bad kamera settings: {exc.errors()[0]['msg']}", param="kamera") from exc
