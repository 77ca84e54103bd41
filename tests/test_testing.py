"""`kamera_agent.testing`: the shipped test doubles stay importable without a test runner, and
their names are pinned (code outside the repository imports them)."""

from __future__ import annotations

import subprocess
import sys

import kamera_agent.testing


def test_the_doubles_are_the_ones_documented() -> None:
    assert kamera_agent.testing.__all__ == [
        "CountingBackend",
        "DictSlots",
        "FakeTier",
        "ShakyTier",
        "UnreadableEntries",
    ]


def test_importing_the_doubles_brings_no_test_runner() -> None:
    script = "import sys, kamera_agent.testing; print(sorted({'pytest', 'hypothesis'} & set(sys.modules)))"
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert run.stdout.strip() == "[]"
