"""The SGLang backend's tests, run in their own environment (marker ``sglang``).

SGLang 0.5.23 pins a transformers older than this project's and a CUDA torch, so its classes
live in .venv-sglang, which scripts/sglang_env.sh builds (idempotently) from PyPI with the CPU
torch held fixed. This test reads the run that builds it when needed and runs
tests/engines/sglang there, begun in the background (tests/side_envs.py): the README's test
command runs it (never skips it), and ``-m sglang`` selects it alone.
"""

from __future__ import annotations

import sys

import pytest

from tests.side_envs import finish


@pytest.mark.sglang
def test_the_sglang_backend_passes_against_sglangs_own_classes() -> None:
    output = finish("tests/engines/test_sglang_env.py")
    print(next(line for line in reversed(output.splitlines()) if " passed" in line), file=sys.stderr)
