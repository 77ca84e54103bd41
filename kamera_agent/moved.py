"""Module paths that moved and names that were renamed, still importable for a release, with a warning.

Why: other programs' settings name kamera's modules and outlive an upgrade of kamera: vLLM's
``kv_connector_module_path``, the SGLang plugin entry point recorded in an installed package's
metadata, a user's own imports. Importing an old path gives the very module at the new path (no
second copy whose state would diverge) and a `DeprecationWarning` that names the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "install", "renamed"]

MOVED = {
    "kamera_agent.backends.sglang": "kamera_agent.engines.sglang",
    "kamera_agent.backends.sglang.plugin": "kamera_agent.engines.sglang.plugin",
    "kamera_agent.backends.sglang.pool": "kamera_agent.engines.sglang.pool",
    "kamera_agent.backends.sglang.radix": "kamera_agent.engines.sglang.radix",
    "kamera_agent.backends.sglang.segments": "kamera_agent.engines.sglang.segments",
    "kamera_agent.backends.vllm": "kamera_agent.engines.vllm",
    "kamera_agent.backends.vllm.blocks": "kamera_agent.engines.vllm.blocks",
    "kamera_agent.backends.vllm.connector": "kamera_agent.engines.vllm.connector",
    "kamera_agent.core.synthesis": "kamera_agent.engines.synthesis",
    "kamera_agent.core.chunking": "kamera_agent.engines.chunking",
    "kamera_agent.core.drift": "kamera_agent.fidelity",
    "kamera_agent.window.budget": "kamera_agent.fidelity",
    "kamera_agent.bench.prefix_cache": "kamera_agent.baselines.prefix_cache",
    "kamera_agent.store.remote.command": "kamera_agent.store.command",
    "kamera_agent.engines.vllm.worker_thread": "kamera_agent.threads",
    "kamera_agent.store.budget": "kamera_agent.store.limits",
    "kamera_agent.core.blend": "kamera_agent.core.recompute",
    "kamera_agent.metrics": "kamera_agent.divergence",
}
"""Old module path → where the module lives now (engine adapters left `backends`; the drift
budget and its estimator gathered in `fidelity`; the prefix-cache baseline went below the
benchmarks and the demo that both run it; ``kamera store`` serves every tier, not only the
Valkey/Redis one; the worker thread serves the store's queues too; modules renamed by what they
hold, so that "budget" names the drift budget alone)."""


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `MOVED` before the file system would (it has no files there)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        where = " (and name it so in vLLM's kv_connector_module_path)" if ".vllm" in new else ""
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there{where}", DeprecationWarning, stacklevel=2
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path is already imported."""


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())


def renamed(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module's ``__getattr__`` (PEP 562) that serves each old name of ``names`` (old → new) as
    the new one, with a `DeprecationWarning` naming it: a renamed public name lasts a release."""

    def __getattr__(name: str) -> Any:
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{name} is now {new} ({module})", DeprecationWarning, stacklevel=2)
        return getattr(sys.modules[module], new)

    return __getattr__
