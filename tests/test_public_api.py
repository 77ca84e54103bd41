"""The public root is small and deliberate: this test pins it."""

from __future__ import annotations

import kamera_agent


def test_root_all_is_pinned() -> None:
    assert sorted(kamera_agent.__all__) == sorted(
        [
            "ChunkKV",
            "ForeignPatchError",
            "KVLayout",
            "KameraError",
            "LayoutMismatchError",
            "LengthDependentRopeError",
            "Patch",
            "PositionShapeError",
            "RelocationError",
            "RotarySpec",
            "UnsupportedModelError",
            "__version__",
            "apply_patch",
            "configure_threads",
            "form_patch",
            "kv_layout",
            "model_fingerprint",
        ]
    )
    for name in kamera_agent.__all__:
        assert hasattr(kamera_agent, name)
