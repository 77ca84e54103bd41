"""The layers of shared/DESIGN.md, held by a test rather than by goodwill.

The import contracts live in pyproject.toml (``[tool.importlinter]``) and are checked by
import-linter; this file runs it, proves it would fail on a forbidden import, and checks the
rules an import contract cannot state (which functions the window calls).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kamera_agent"
pytestmark = pytest.mark.lint


def _lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    script = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    command = [sys.executable, "-c", script, "--no-cache"]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=120)


def test_the_import_contracts_are_kept() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_a_forbidden_import_breaks_a_contract(tmp_path: Path) -> None:
    """The contracts can fail: the operator importing the window is reported by name."""
    copy = tmp_path / "kamera_agent"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "kamera-tiny-vl"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    rope = copy / "operator" / "rope.py"
    rope.write_text(rope.read_text() + "\nimport kamera_agent.window  # a forbidden import\n")
    result = _lint_imports(tmp_path, pythonpath=tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "kamera_agent.operator.rope -> kamera_agent.window" in result.stdout
    assert "BROKEN" in result.stdout


def _calls(folder: Path) -> set[tuple[str, str]]:
    """(file, name) of every name a module under ``folder`` refers to or imports."""
    found: set[tuple[str, str]] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                found.add((path.name, node.id))
            elif isinstance(node, ast.Attribute):
                found.add((path.name, node.attr))
            elif isinstance(node, ast.ImportFrom):
                found |= {(path.name, alias.name) for alias in node.names}
    return found


def test_the_window_forms_no_kv() -> None:
    """Formation, the position-free form and orbit merging are the core's (`KVCore`)."""
    forbidden = {"form_patch", "to_position_free", "merge_patches"}
    used = {(name, what) for name, what in _calls(PACKAGE / "window") if what in forbidden}
    assert not used, used


def test_backends_hold_no_engine_adapter() -> None:
    """`backends/` holds `Backend` engines only; kamera inside SGLang and vLLM is `engines/`."""
    engines = ("import sglang", "from sglang", "import vllm", "from vllm")
    offenders = [
        str(path.relative_to(ROOT))
        for path in (PACKAGE / "backends").rglob("*.py")
        if any(word in path.read_text() for word in engines)
    ]
    assert not (PACKAGE / "backends" / "sglang").exists() and not (PACKAGE / "backends" / "vllm").exists()
    assert not offenders, offenders
