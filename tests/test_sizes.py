"""Modules of one screen: no module in the package over 500 lines, no function over 60.

Why a test: a file or a function past these sizes is doing more than one job (STYLE.md: split
by role), and sizes only grow unless something says no. A function counts from its ``def`` line
to its last line (``end_lineno - lineno + 1``, decorators not counted), nested ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kamera_agent"
MODULE_LINES = 500
FUNCTION_LINES = 60
pytestmark = pytest.mark.lint


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def test_no_module_is_over_500_lines() -> None:
    sizes = {_name(path): len(path.read_text(encoding="utf-8").splitlines()) for path in _modules()}
    over = [f"{name}: {lines} lines" for name, lines in sizes.items() if lines > MODULE_LINES]
    assert not over, f"modules over {MODULE_LINES} lines (split each by responsibility): {over}"


def _long_functions(source: str, name: str) -> list[str]:
    """Each function of ``source`` over the limit, as ``name:line function: n lines``."""
    over = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > FUNCTION_LINES:
                over.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    return over


def test_no_function_is_over_60_lines() -> None:
    over = [
        line for path in _modules() for line in _long_functions(path.read_text(encoding="utf-8"), _name(path))
    ]
    assert not over, f"functions over {FUNCTION_LINES} lines (name their parts): {over}"


def test_the_count_names_an_offender_and_spares_what_fits() -> None:
    """A 61-line function (a method, too) is named with its line; a 60-line one is not."""
    body = "\n".join(f"        x{i} = {i}" for i in range(59))
    fits = f"    def fits(self) -> None:\n{body}\n"  # lines 2-61
    long = f"    def long(self) -> None:\n{body}\n        x = 0\n"  # lines 63-123
    assert _long_functions(f"class A:\n{fits}\n{long}", "a.py") == ["a.py:63 long: 61 lines"]
