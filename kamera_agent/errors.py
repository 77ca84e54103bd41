"""Exceptions raised by kamera-agent.

Every error names the problem and the fix, and is raised *before* anything is mutated, so a
failed call never corrupts a window or a store.

    KameraError
    ├── UnsupportedModelError        model family we have no rotary spec / KV layout for
    │   └── TokenizerNotFoundError   a model whose tokenizer is neither given nor found at its origin
    ├── CapabilityError              an operation this backend does not offer
    ├── SettingsError                a setting that cannot apply where it was given
    │   └── ConfigError              a WindowConfig value its validation refuses
    ├── CheckpointError              a model path that is not a local checkpoint kamera can load
    ├── RelocationError              the rotary scheme cannot be relocated exactly
    │   └── LengthDependentRopeError dynamic NTK, longrope: frequencies change with length
    ├── PositionShapeError           positions of the wrong shape / length for the keys
    ├── LayoutMismatchError          tensors whose shapes do not match the model's KV layout
    ├── ForeignPatchError            a patch or chunk made for another chunk or another model
    │   └── ForeignChunkError        a stored entry made by another model than the store's
    ├── StoreLimitError              a store's byte limit too small for one entry, or not a byte count
    ├── StoreKeyError                an entry without the content key it must be stored under
    ├── StoreURLError                a store_url kamera cannot connect by (scheme, host, option)
    │   └── UnknownTierSchemeError   a store_url whose scheme no tier is registered for
    ├── StoreUnavailableError        a shared store that did not answer ``kamera store``
    ├── StoreDirectoryError          a disk_dir kamera cannot use (not a directory, no access)
    ├── WindowError                  a window op that cannot be done as asked
    │   ├── UnknownChunkError        a ref this window does not know
    │   ├── DuplicateChunkError      a ref named twice in a reorder
    │   ├── ChunkInWindowError       recall of a chunk already in the window
    │   ├── CapacityError            a capacity smaller than one chunk
    │   ├── ChunkLostError           an evicted chunk whose KV, vision output and pixels are all gone
    │   ├── ContextOverflowError     window + query longer than the model's context
    │   ├── ArgumentError            an op's argument of the wrong type or out of range (a TypeError too)
    │   └── WindowClosedError        an op on a window whose store was closed
    └── InputError                   content that cannot become a chunk
        ├── AmbiguousChannelOrderError  an array that could be RGB or BGR
        ├── UnreadableInputError        a missing or unreadable file, stream or object
        ├── MediaPathAsTextError        a str that names an image or video file, pushed as text
        ├── EmptyVideoError             a video with no frames
        └── ProcessorRejectedError      an image the model's processor refuses

Warnings (not errors: the call goes on): ``KameraWarning`` ⟵ ``LargeChunkWarning``,
``UncalibratedWarning``.
"""

from __future__ import annotations

from kamera_agent.moved import renamed

__all__ = [
    "AmbiguousChannelOrderError",
    "ArgumentError",
    "CapabilityError",
    "CapacityError",
    "CheckpointError",
    "ChunkInWindowError",
    "ChunkLostError",
    "ConfigError",
    "ContextOverflowError",
    "DuplicateChunkError",
    "EmptyVideoError",
    "ForeignChunkError",
    "ForeignPatchError",
    "InputError",
    "KameraError",
    "KameraWarning",
    "LargeChunkWarning",
    "LayoutMismatchError",
    "LengthDependentRopeError",
    "MediaPathAsTextError",
    "PositionShapeError",
    "ProcessorRejectedError",
    "RelocationError",
    "SettingsError",
    "StoreDirectoryError",
    "StoreKeyError",
    "StoreLimitError",
    "StoreURLError",
    "StoreUnavailableError",
    "TokenizerNotFoundError",
    "UncalibratedWarning",
    "UnknownChunkError",
    "UnknownTierSchemeError",
    "UnreadableInputError",
    "UnsupportedModelError",
    "WindowClosedError",
    "WindowError",
]


class KameraError(Exception):
    """Base class of every error kamera-agent raises on purpose."""


class UnsupportedModelError(KameraError):
    """The model's family has no known rotary layout or KV layout."""


class TokenizerNotFoundError(UnsupportedModelError):
    """No tokenizer was passed and none is found where the model came from (its folder, or the
    GGUF file it was read from carries none); the message says what to pass."""


class CapabilityError(KameraError):
    """An operation the backend does not offer (no vision tower, no reference forward)."""


class SettingsError(KameraError, ValueError):
    """A setting that cannot apply where it was given; the message says where to set it."""


class ConfigError(SettingsError):
    """A `WindowConfig` value its validation refuses (pydantic's messages, one per problem);
    ``errors()`` lists them as pydantic does (``loc``, ``msg``, ``type``)."""

    def __init__(self, message: str, errors: list[dict[str, object]] | None = None) -> None:
        super().__init__(message)
        self._errors = errors or []

    def errors(self) -> list[dict[str, object]]:
        return list(self._errors)


class CheckpointError(KameraError, ValueError):
    """A model path that is not a local checkpoint kamera can load (no such folder, no config)."""


class KameraWarning(UserWarning):
    """Something worth knowing that does not stop the call."""


class LargeChunkWarning(KameraWarning):
    """A chunk over ``WindowConfig.large_chunk_tokens``: slow to prefill, large to store."""


class UncalibratedWarning(KameraWarning):
    """A drift budget asked of a model with no calibration: the window runs exactly instead."""


class RelocationError(KameraError):
    """Keys of this model cannot be moved to a new position by an exact rotation."""


class LengthDependentRopeError(RelocationError):
    """The rotary frequencies depend on the sequence length, so a stored key has no fixed phase."""


class PositionShapeError(KameraError, ValueError):
    """Positions do not match the keys (wrong rank, wrong length, or 1-D where M-RoPE needs 3 rows)."""


class LayoutMismatchError(KameraError, ValueError):
    """A tensor's shape does not match the KV layout it is used with."""


class ForeignPatchError(KameraError):
    """A patch applied to a chunk, or a chunk used with a model, that it was not made for."""


class ForeignChunkError(ForeignPatchError):
    """A stored entry's model fingerprint differs from the fingerprint of the store serving it."""


class StoreLimitError(KameraError, ValueError):
    """A store's byte limit cannot hold even one entry (or is not a positive byte count)."""


class StoreKeyError(KameraError, ValueError):
    """An entry lacks the content key the store files it under (empty chunk key, reserved name)."""


class StoreDirectoryError(KameraError, OSError):
    """A disk tier directory kamera cannot use: not a directory, not writable, or its index
    unreadable (any number of processes may share one ``disk_dir``)."""


class StoreURLError(KameraError, ValueError):
    """A shared-store URL that names no server kamera can use (scheme, host list, option)."""


class StoreUnavailableError(KameraError, ConnectionError):
    """A shared store that did not answer an operator's command (``kamera store stats|clear``):
    down, unreachable, or refusing the credentials; the message names the place."""


class UnknownTierSchemeError(StoreURLError):
    """A store URL whose scheme names no registered tier; the message lists the registered ones
    and how to register another (`kamera_agent.store.registry`)."""


class InputError(KameraError, ValueError):
    """Content an agent pushed cannot be turned into a chunk."""


class AmbiguousChannelOrderError(InputError):
    """An image array could be RGB or BGR; kamera-agent never guesses which."""


class UnreadableInputError(InputError):
    """A file, stream or object that cannot be read as an image, video or document."""


class MediaPathAsTextError(InputError):
    """A ``str`` that reads as an image or video file name was pushed: pass a ``Path`` for the file,
    or wrap the characters in ``Text(...)`` to push them as text."""


class EmptyVideoError(InputError):
    """A video that opened but yielded no frame."""


class ProcessorRejectedError(InputError):
    """The model's image processor refused an image (too small, wrong shape ...)."""


class WindowError(KameraError, ValueError):
    """A window operation that cannot be done as asked; the window is left unchanged."""


class UnknownChunkError(WindowError):
    """A chunk ref this window does not know (never pushed here, or from another window)."""


class DuplicateChunkError(WindowError):
    """The same chunk named twice where each must appear once (a reorder)."""


class ChunkInWindowError(WindowError):
    """Recall of a chunk that is already in the window."""


class CapacityError(WindowError):
    """A capacity smaller than one chunk, or a chunk that can never fit."""


class ChunkLostError(WindowError):
    """An evicted chunk that can no longer be rebuilt: its canonical and vision output left the
    store after its pixels were released; push the content again."""


class ContextOverflowError(WindowError):
    """The window plus the query (and the answer) would exceed the model's context length."""


class ArgumentError(WindowError, TypeError):
    """An op's argument of the wrong type or out of range (``slide(1.5)``, ``ask(None)``,
    ``push(label=5)``); nothing was changed. Also a ``TypeError`` and a ``ValueError``."""


class WindowClosedError(WindowError):
    """An op or read on a window after ``close()`` (its store is closed: nothing more would be
    written); open a new window over the store's directory or URL."""


__getattr__ = renamed(__name__, {"StoreBudgetError": "StoreLimitError"})
"""A byte cap is a *limit* ("budget" is the drift budget's word): the old name lasts a release."""
