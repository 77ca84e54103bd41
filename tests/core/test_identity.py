"""`patched_digest` names exactly the state `ChunkState.patched` makes (planning looks the store
up by it before any state is built)."""

from __future__ import annotations

from kamera_agent.core.identity import ChunkState, Context, orbit_digest, patched_digest


def test_patched_digest_is_the_patched_states_digest_over_any_context() -> None:
    root = Context.root("anchor")
    context = root.extend(ChunkState.canonical("a", root)).extend(ChunkState.patched("b", "full", root))
    for ctx in (root, context):
        for rank in ("full", 4, 16):
            assert patched_digest("c", rank, ctx) == ChunkState.patched("c", rank, ctx).digest
    assert patched_digest("c", 4, context) != patched_digest("c", "full", context)


def test_orbit_digest_is_the_orbit_states_digest() -> None:
    root = Context.root("anchor")
    for members in (["m1"], ["m1", "m2"]):
        state = ChunkState.orbit("c", "full", root, "address", members)
        assert orbit_digest("c", "full", root, "address", members) == state.digest
