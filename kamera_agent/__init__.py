"""kamera-agent: hold, move, drop and bring back multimodal context without paying for it again.

A chunk (frame, screenshot, page, text span) is cached once, position-free; reuse is an exact
RoPE relocation plus a small low-rank patch that restores what the chunk absorbed from the
chunks before it. ``KameraWindow`` is the face of it:

    window = KameraWindow(model, processor)
    window.push(frame)
    window.ask("What changed?")

See shared/DESIGN.md and docs/ for the picture.

The public names are imported on first use (PEP 562), not with the package: the ``kamera``
command imports this package before it parses its arguments, and ``kamera --help`` should not
wait for torch. ``from kamera_agent import KameraWindow`` reads exactly as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kamera_agent import moved
from kamera_agent.errors import (  # no third-party imports: cheap to import eagerly
    AmbiguousChannelOrderError,
    ArgumentError,
    CapabilityError,
    CapacityError,
    CheckpointError,
    ChunkInWindowError,
    ChunkLostError,
    ConfigError,
    ContextOverflowError,
    DuplicateChunkError,
    EmptyVideoError,
    ForeignChunkError,
    ForeignPatchError,
    InputError,
    KameraError,
    LayoutMismatchError,
    LengthDependentRopeError,
    MediaPathAsTextError,
    PositionShapeError,
    ProcessorRejectedError,
    RelocationError,
    SettingsError,
    StoreKeyError,
    StoreLimitError,
    TokenizerNotFoundError,
    UnknownChunkError,
    UnreadableInputError,
    UnsupportedModelError,
    WindowClosedError,
    WindowError,
)

if TYPE_CHECKING:
    from kamera_agent.backends import Backend, DecodeConfig, TransformersBackend
    from kamera_agent.chunks.sources import Text
    from kamera_agent.config import WindowConfig
    from kamera_agent.fingerprint import model_fingerprint
    from kamera_agent.loading import load_backend
    from kamera_agent.results import Answer, Edit, OpCost, Plan, Probe, WindowStats
    from kamera_agent.settings import configure_threads
    from kamera_agent.store import ChunkStore
    from kamera_agent.window import ChunkRef, KameraWindow

__version__ = "0.1.0"

moved.install()

_HOMES: dict[str, str] = {
    **dict.fromkeys(("Backend", "DecodeConfig", "TransformersBackend"), "kamera_agent.backends"),
    "Text": "kamera_agent.chunks.sources",
    "WindowConfig": "kamera_agent.config",
    "model_fingerprint": "kamera_agent.fingerprint",
    "load_backend": "kamera_agent.loading",
    **dict.fromkeys(("Answer", "Edit", "OpCost", "Plan", "Probe", "WindowStats"), "kamera_agent.results"),
    "configure_threads": "kamera_agent.settings",
    "ChunkStore": "kamera_agent.store",
    **dict.fromkeys(("ChunkRef", "KameraWindow"), "kamera_agent.window"),
}
"""Each public name → the module it lives in (imported when the name is first read)."""

_RENAMED = {"StoreBudgetError": "kamera_agent.errors"}
"""Each old public name → the module that serves it, with a `DeprecationWarning`, for a release."""


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then held here); a submodule
    reached as an attribute (``kamera_agent.window`` after ``import kamera_agent``), as the
    eager root made possible."""
    if name in _RENAMED:
        return getattr(importlib.import_module(_RENAMED[name]), name)  # its module warns
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists and failed to import: say so
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "AmbiguousChannelOrderError",
    "Answer",
    "ArgumentError",
    "Backend",
    "CapabilityError",
    "CapacityError",
    "CheckpointError",
    "ChunkInWindowError",
    "ChunkLostError",
    "ChunkRef",
    "ChunkStore",
    "ConfigError",
    "ContextOverflowError",
    "DecodeConfig",
    "DuplicateChunkError",
    "Edit",
    "EmptyVideoError",
    "ForeignChunkError",
    "ForeignPatchError",
    "InputError",
    "KameraError",
    "KameraWindow",
    "LayoutMismatchError",
    "LengthDependentRopeError",
    "MediaPathAsTextError",
    "OpCost",
    "Plan",
    "PositionShapeError",
    "Probe",
    "ProcessorRejectedError",
    "RelocationError",
    "SettingsError",
    "StoreKeyError",
    "StoreLimitError",
    "Text",
    "TokenizerNotFoundError",
    "TransformersBackend",
    "UnknownChunkError",
    "UnreadableInputError",
    "UnsupportedModelError",
    "WindowClosedError",
    "WindowConfig",
    "WindowError",
    "WindowStats",
    "__version__",
    "configure_threads",
    "load_backend",
    "model_fingerprint",
]
