"""The SGLang backend's tests, run in their own environment (marker ``sglang``).

SGLang 0.5.23 pins a transformers older than this project's and a CUDA torch, so its classes
live in .venv-sglang, which scripts/sglang_env.sh builds (idempotently) from PyPI with the CPU
torch held fixed. This test builds it when needed and runs tests/engines/sglang there: the
README's test command runs it (never skips it), and ``-m sglang`` selects it alone.
"""

from __future__ import annotations

import sys

import pytest

from tests.side_envs import ROOT, build_env, run_tests


@pytest.mark.sglang
def test_the_sglang_backend_passes_against_sglangs_own_classes() -> None:
    build_env("sglang_env.sh")
    # SGLang warns at import about kernels a CPU lacks (AWQ, GGUF): not ours to fix
    output = run_tests(
        ROOT / ".venv-sglang" / "bin" / "python",
        "tests/engines/sglang",
        ("UserWarning", "DeprecationWarning", "FutureWarning"),
        timeout=900,
        KAMERA_NUM_THREADS="1",
    )
    print(next(line for line in reversed(output.splitlines()) if " passed" in line), file=sys.stderr)
