"""The engine versions kamera's adapters are built and tested against, checked at startup.

Why: the adapters meet each engine's own contracts, including a few private ones (vLLM's CPU
attention ISA, SGLang's radix-cache registry), which change between minor releases. An engine
outside the tested range fails at startup with a named error that says which version is
installed and which are supported, never later inside a request. ``KAMERA_ALLOW_ENGINE_VERSION``
set to the installed version (or ``any``) runs it anyway, with one warning.
"""

from __future__ import annotations

import os
import warnings

from packaging.version import InvalidVersion, Version

from kamera_agent.errors import KameraError, KameraWarning

__all__ = ["ALLOW_VARIABLE", "SUPPORTED", "EngineVersionError", "check_engine_version"]

SUPPORTED: dict[str, tuple[str, str]] = {
    "vllm": ("0.32.0", "0.33"),
    "sglang": ("0.5.23", "0.6"),
}
"""Per engine, the ``[lowest, first unsupported)`` versions: what the adapters' tests run on."""
ALLOW_VARIABLE = "KAMERA_ALLOW_ENGINE_VERSION"


class EngineVersionError(KameraError):
    """An installed engine version outside the range kamera's adapter supports."""


def check_engine_version(engine: str, installed: str) -> None:
    """Refuse ``installed`` (e.g. ``vllm.__version__``) outside ``SUPPORTED[engine]``.

    Raises:
        EngineVersionError: the version is outside the range (or unreadable) and
            ``$KAMERA_ALLOW_ENGINE_VERSION`` does not name it.
    """
    low, high = SUPPORTED[engine]
    try:
        version = Version(installed)
        inside = Version(low) <= version < Version(high)
    except InvalidVersion:
        inside = False
    if inside:
        return
    allowed = os.environ.get(ALLOW_VARIABLE, "")
    message = (
        f"{engine} {installed} is installed; kamera's {engine} adapter supports {low} up to (not "
        f"including) {high}, the versions its tests run on. Install one of those, or set "
        f"{ALLOW_VARIABLE}={installed} to run it anyway"
    )
    if allowed in (installed, "any"):
        warnings.warn(
            message.split(". Install")[0] + f": running anyway ({ALLOW_VARIABLE})",
            KameraWarning,
            stacklevel=2,
        )
        return
    raise EngineVersionError(message)
