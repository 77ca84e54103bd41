"""The public root is small and deliberate: this test pins it (STYLE.md: a curated root)."""

from __future__ import annotations

import kamera_agent


def test_root_all_is_pinned() -> None:
    assert sorted(kamera_agent.__all__) == sorted(
        [
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
            "WindowConfig",
            "WindowClosedError",
            "WindowError",
            "WindowStats",
            "__version__",
            "configure_threads",
            "load_backend",
            "model_fingerprint",
        ]
    )
    for name in kamera_agent.__all__:
        assert hasattr(kamera_agent, name)


def test_operator_building_blocks_stay_importable() -> None:
    from kamera_agent.backends.transformers import kv_layout
    from kamera_agent.operator import apply_patch, form_patch, relocate

    assert all(callable(f) for f in (apply_patch, form_patch, kv_layout, relocate))


def test_renamed_fields_keep_their_old_names_with_a_warning() -> None:
    import pytest

    from kamera_agent import OpCost

    with pytest.warns(DeprecationWarning, match="reforms"):
        assert OpCost(reforms=2).reencodes == 2
