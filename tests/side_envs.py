"""Running a test folder in one of the side environments (.venv-sglang, .venv-vllm).

Both engines pin dependencies this project's .venv cannot share, so their tests run in their
own interpreter; this is the one way the main suite starts them and reads their result.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_env(script: str, timeout: float = 1800) -> None:
    """Build (or find up to date) a side environment with ``scripts/<script>``: on first use, so the
    README's first command (the demo) never waits for an engine it does not use."""
    built = subprocess.run(
        ["bash", str(ROOT / "scripts" / script)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]


def run_tests(python: Path, folder: str, ignore: Sequence[str], timeout: float, **env: str) -> str:
    """``pytest folder`` under ``python`` (warnings of ``ignore`` categories, which the engines'
    own imports raise, not failures); its output, after asserting that it passed."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ.update(HF_HUB_OFFLINE="1", **env)
    warnings = [arg for category in ignore for arg in ("-W", f"ignore::{category}")]
    command = [str(python), "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *warnings, folder]
    ran = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout)
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-3000:]
    assert " passed" in ran.stdout and "failed" not in ran.stdout, ran.stdout[-2000:]
    return ran.stdout + ran.stderr
