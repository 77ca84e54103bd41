"""Each ``kamera`` command's parser, declared apart from what the command runs.

Why apart: a command's own module imports torch and the model stack (seconds), and
``kamera --help``, ``kamera serve --help`` or ``kamera --version`` need none of it. These modules
import the standard library only; the command's module is imported when it runs
(`kamera_agent.cli`). What a parser offers as choices (bench rows, agents, dtypes) is listed
here, and a test holds each list to the one the command runs on.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["DefaultsShown", "add_chat_template", "add_command", "positive"]


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ``(default: …)`` after each argument whose default says something: not after a
    flag (off), a default of nothing, or help text that already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False) or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def add_command(commands: Any, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    """A ``kamera`` command: ``summary`` in ``kamera --help``, ``description`` atop its own help."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=summary, description=description, formatter_class=DefaultsShown
    )
    return parser


def positive(text: str) -> int:
    """An argument that must be a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_chat_template(parser: argparse.ArgumentParser, used_by: str = "") -> None:
    """``--chat-template``: the Jinja template serve renders requests with, the model's own replaced."""
    parser.add_argument(
        "--chat-template",
        default=None,
        help=f"{used_by}a Jinja chat template (a file, or the template itself) replacing the model's own; "
        "a base model without one needs it",
    )
