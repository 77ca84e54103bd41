"""Old module paths keep working: each is the module at its new path, with a DeprecationWarning.

Other programs' settings name kamera's modules (vLLM's ``kv_connector_module_path``, SGLang's
plugin entry point recorded in an installed package), so an upgrade must not break them. Each
import runs in a fresh interpreter: the warning fires on a module's first import only. The
engines' own old paths are tested in their environments (tests/engines/sglang/test_plugin.py,
tests/engines/vllm/test_connector.py), where SGLang and vLLM import.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kamera_agent.moved import MOVED


def import_in_fresh_interpreter(old: str) -> subprocess.CompletedProcess[str]:
    new = MOVED[old]
    script = f"""
import importlib, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    old = importlib.import_module({old!r})
new = importlib.import_module({new!r})
assert old is new, (old, new)
moved = [w for w in caught if issubclass(w.category, DeprecationWarning) and {new!r} in str(w.message)]
assert moved, [str(w.message) for w in caught]
print(moved[0].message)
"""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "old",
    [
        "kamera_agent.core.synthesis",
        "kamera_agent.backends.sglang.segments",
        "kamera_agent.core.drift",
        "kamera_agent.store.remote.command",
    ],
)
def test_an_old_path_is_the_new_module_with_a_warning(old: str) -> None:
    done = import_in_fresh_interpreter(old)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{old} moved to {MOVED[old]}" in done.stdout


def test_every_old_path_names_a_module_that_exists() -> None:
    import importlib.util

    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        assert old == "kamera_agent.metrics" or old.startswith(
            (
                "kamera_agent.backends.",
                "kamera_agent.bench.",
                "kamera_agent.core.",
                "kamera_agent.store.",
                "kamera_agent.window.",
                "kamera_agent.engines.vllm.worker_thread",
            )
        ), old
