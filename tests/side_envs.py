"""Side runs: test folders run in a process of their own, beside the main suite.

Both engines pin dependencies this project's .venv cannot share, so their tests run in their
own environments (.venv-sglang, .venv-vllm); the window's property tests run in .venv, apart
only so that they run at the same time as the rest. This is the one way the main suite starts
them and reads their result.

Why in the background: the main suite runs on one torch thread, so on a 2-core machine one core
sits idle while it runs. Building a side environment (minutes of pip) and running a side folder
need nothing from the main suite, so `start` begins them in a thread as soon as collection has
chosen their reading test (tests/conftest.py), those tests run last, and `finish` only waits
for what is left. The main suite does not collect a side folder itself unless it is named on
the command line (`IN_SIDE_RUN` marks the side run's own process).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

IN_SIDE_RUN = "KAMERA_SIDE_RUN"
"""Set in a side run's process: there its folder is collected."""


def build_env(script: str, timeout: float = 1800) -> None:
    """Build (or find up to date) a side environment with ``scripts/<script>``: on first use, so the
    README's first command (the demo) never waits for an engine it does not use."""
    built = _run(["bash", str(ROOT / "scripts" / script)], os.environ, timeout)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]


def run_tests(python: Path, folder: str, ignore: Sequence[str], timeout: float, **env: str) -> str:
    """``pytest folder`` under ``python`` (warnings of ``ignore`` categories, which the engines'
    own imports raise, not failures); its output, after asserting that it passed."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ.update(HF_HUB_OFFLINE="1", **{IN_SIDE_RUN: "1"}, **env)
    warnings = [arg for category in ignore for arg in ("-W", f"ignore::{category}")]
    command = [str(python), "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *warnings, folder]
    ran = _run(command, environ, timeout)
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-3000:]
    # "1 xfailed" is a strict expected failure, not a failure
    assert " passed" in ran.stdout and not re.search(r"\d+ failed", ran.stdout), ran.stdout[-2000:]
    return ran.stdout + ran.stderr


_children: set[subprocess.Popen[str]] = set()
_stopping = threading.Event()


def _run(command: list[str], env: Mapping[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``command`` to its end (killed past ``timeout``, or by `stop`), in a session of its own so
    that stopping it stops what it started (pip, vllm serve)."""
    if _stopping.is_set():
        raise RuntimeError("the test session ended before this side run began")
    child = subprocess.Popen(
        command,
        cwd=ROOT,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _children.add(child)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(child)
        child.communicate()
        raise
    finally:
        _children.discard(child)
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def _kill(child: subprocess.Popen[str]) -> None:
    """End ``child`` and what it started (its thread, waiting on it, then returns)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)


@dataclass(frozen=True)
class SideRun:
    """A side environment's build (``scripts/<script>``; ``None``: .venv, built already) and its
    test folder's run there."""

    script: str | None
    python: Path
    folder: str
    ignore: tuple[str, ...]
    timeout: float
    env: dict[str, str] = field(default_factory=dict)

    def __call__(self) -> str:
        if self.script is not None:
            build_env(self.script)
        return run_tests(self.python, self.folder, self.ignore, self.timeout, **self.env)


SIDE_RUNS: dict[str, SideRun] = {
    # SGLang warns at import about kernels a CPU lacks (AWQ, GGUF): not ours to fix
    "tests/engines/test_sglang_env.py": SideRun(
        "sglang_env.sh",
        ROOT / ".venv-sglang" / "bin" / "python",
        "tests/engines/sglang",
        ("UserWarning", "DeprecationWarning", "FutureWarning"),
        timeout=900,
        env={"KAMERA_NUM_THREADS": "1"},
    ),
    # vLLM's own imports warn about torch APIs it still uses: not ours to fix
    "tests/engines/test_vllm_env.py": SideRun(
        "vllm_env.sh",
        ROOT / ".venv-vllm" / "bin" / "python",
        "tests/engines/vllm",
        ("DeprecationWarning", "FutureWarning"),
        timeout=1800,  # the suite runs ~10 engines and 3 vllm serve processes: ~5 min alone here
        env={"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
    ),
    # the suite's longest tests, on the core the main suite leaves idle
    "tests/window/test_window_properties_run.py": SideRun(
        None, Path(sys.executable), "tests/window/properties", (), timeout=2400
    ),
}
"""The side runs, by the test file that reads each one's result."""

SIDE_FOLDERS = frozenset(run.folder for run in SIDE_RUNS.values() if run.script is None)
"""The side folders .venv could collect, which the main suite leaves to their side runs."""

_pool = ThreadPoolExecutor(max_workers=len(SIDE_RUNS), thread_name_prefix="side-run")
_started: dict[str, Future[str]] = {}


def start(test_file: str) -> None:
    """Begin ``test_file``'s side run in the background (once)."""
    if test_file not in _started:
        _started[test_file] = _pool.submit(SIDE_RUNS[test_file])


def stop() -> None:
    """End every side run still going (the session is over: no test will read them)."""
    _stopping.set()
    for child in list(_children):
        _kill(child)
    _pool.shutdown(wait=False, cancel_futures=True)


def finish(test_file: str) -> str:
    """``test_file``'s side run's output, once it has passed (started now if it was not)."""
    start(test_file)
    return _started[test_file].result()
