"""kamera-agent: keep, move, drop and bring back multimodal context without paying for it again.

A chunk (frame, screenshot, page, text span) is cached once, position-free; reuse is an exact
RoPE relocation plus a small low-rank patch that restores what the chunk absorbed from the
chunks before it. ``KameraWindow`` is the face of it:

    window = KameraWindow(model, processor)
    window.push(frame)
    window.ask("What changed?")

See shared/DESIGN.md and docs/ for the picture.
"""

from kamera_agent import moved
from kamera_agent.backends import Backend, DecodeConfig, TransformersBackend
from kamera_agent.chunks.sources import Text
from kamera_agent.config import WindowConfig
from kamera_agent.errors import (
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
    StoreBudgetError,
    StoreKeyError,
    TokenizerNotFoundError,
    UnknownChunkError,
    UnreadableInputError,
    UnsupportedModelError,
    WindowClosedError,
    WindowError,
)
from kamera_agent.fingerprint import model_fingerprint
from kamera_agent.loading import load_backend
from kamera_agent.results import Answer, Edit, OpCost, Plan, Probe, WindowStats
from kamera_agent.settings import configure_threads
from kamera_agent.store import ChunkStore
from kamera_agent.window import ChunkRef, KameraWindow

__version__ = "0.1.0"

moved.install()

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
    "StoreBudgetError",
    "StoreKeyError",
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
