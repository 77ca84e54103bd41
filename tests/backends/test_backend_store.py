"""The backend and the content-addressed store: counted hits, reloads, evictions, foreign models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kamera_agent.backends import TransformersBackend
from kamera_agent.errors import ForeignChunkError, StoreBudgetError
from kamera_agent.store import ChunkStore
from tests.backends.test_transformers_backend import images, sharpen
from tests.tiny_models import tiny_qwen2_5_vl, tiny_qwen2_vl
from tests.tiny_processors import tiny_image_processor, tiny_tokenizer


def _backend(store: ChunkStore | None = None, model: object | None = None) -> TransformersBackend:
    model = model or sharpen(tiny_qwen2_vl())
    return TransformersBackend(
        model, tokenizer=tiny_tokenizer(), image_processor=tiny_image_processor("qwen2_vl"), store=store
    )


def test_an_image_the_store_holds_runs_no_vision_and_no_lm_forward() -> None:
    backend = _backend()
    chunk = backend.encoder.image(images(1, seed=11)[0])
    first = backend.encode(chunk)
    backend.anchor_kv()
    before = backend.counters.snapshot()
    again = backend.encode(backend.encoder.image(images(1, seed=11)[0]))  # re-pushed: a new Chunk object
    spent = backend.counters.since(before)
    assert (spent.lm_forwards, spent.vision_forwards, spent.canonical_hits) == (0, 0, 1)
    assert torch.equal(again.keys, first.keys) and torch.equal(again.values, first.values)


def test_a_canonical_evicted_from_the_store_is_rebuilt_without_the_vision_tower() -> None:
    backend = _backend()
    chunk = backend.encoder.image(images(1, seed=12)[0])
    canonical = backend.encode(chunk)
    vision = backend.store.get_vision(chunk.vision_key)  # type: ignore[arg-type]
    assert vision is not None
    vision_bytes = sum(t.numel() * t.element_size() for t in vision.values())
    # A store that holds the vision output and one canonical; largest-first evicts canonicals.
    small = ChunkStore(
        fingerprint=backend.fingerprint, memory_budget=vision_bytes + canonical.nbytes, policy="largest_first"
    )
    small.put_vision(chunk.vision_key, vision)  # type: ignore[arg-type]
    small.put_canonical(canonical)
    backend.store = small
    backend.encode(backend.encoder.text("abcd"))  # 4 tokens: pushes the larger image canonical out
    assert small.get_canonical(chunk.key) is None and small.stats().dropped >= 1
    before = backend.counters.snapshot()
    rebuilt = backend.encode(chunk)
    spent = backend.counters.since(before)
    assert (spent.vision_forwards, spent.vision_cache_hits, spent.lm_forwards) == (0, 1, 1)
    torch.testing.assert_close(rebuilt.keys, canonical.keys)


def test_a_new_backend_on_the_same_directory_reloads_the_disk_tier(tmp_path: Path) -> None:
    model = sharpen(tiny_qwen2_vl())
    first = _backend(
        ChunkStore(
            fingerprint=_backend(model=model).fingerprint,
            memory_budget=1 << 24,
            disk_dir=tmp_path,
            disk_budget=1 << 24,
        ),
        model,
    )
    chunk = first.encoder.image(images(1, seed=13)[0])
    canonical = first.encode(chunk)
    first.store.flush()
    first.store.close()
    reopened = ChunkStore(
        fingerprint=first.fingerprint, memory_budget=1 << 24, disk_dir=tmp_path, disk_budget=1 << 24
    )
    second = _backend(reopened, model)
    before = second.counters.snapshot()
    again = second.encode(second.encoder.image(images(1, seed=13)[0]))
    assert second.counters.since(before).lm_forwards == 0
    assert torch.equal(again.keys, canonical.keys)


def test_stores_refuse_another_models_entries_and_budgets_below_one_chunk() -> None:
    backend = _backend()
    other = _backend(model=sharpen(tiny_qwen2_5_vl()))
    with pytest.raises(ForeignChunkError, match="another model"):
        _backend(other.store, backend.model)
    chunk = backend.encoder.image(images(1, seed=14)[0])
    tiny = ChunkStore(fingerprint=backend.fingerprint, memory_budget=64)
    backend.store = tiny
    with pytest.raises(StoreBudgetError, match="budget"):
        backend.encode(chunk)
    assert tiny.stats().memory_bytes == 0


def test_a_corrupted_spill_file_is_dropped_and_the_chunk_re_encoded(tmp_path: Path) -> None:
    model = sharpen(tiny_qwen2_vl())
    fingerprint = _backend(model=model).fingerprint
    store = ChunkStore(fingerprint=fingerprint, memory_budget=1 << 24, disk_dir=tmp_path, disk_budget=1 << 24)
    backend = _backend(store, model)
    chunk = backend.encoder.image(images(1, seed=15)[0])
    canonical = backend.encode(chunk)
    store.flush()
    store.close()
    (spilled,) = tmp_path.glob("canonical-*.safetensors")
    data = bytearray(spilled.read_bytes())
    data[len(data) // 2] ^= 0xFF
    spilled.write_bytes(bytes(data))
    reopened = ChunkStore(
        fingerprint=fingerprint, memory_budget=1 << 24, disk_dir=tmp_path, disk_budget=1 << 24
    )
    again = _backend(reopened, model)
    again.anchor_kv()
    before = again.counters.snapshot()
    rebuilt = again.encode(chunk)
    assert again.counters.since(before).lm_forwards == 1  # re-encoded, never served corrupt
    assert reopened.stats().corrupt_dropped == 1
    torch.testing.assert_close(rebuilt.keys, canonical.keys)


def test_qwen3_vl_deepstack_features_are_part_of_the_chunks_own_canonical() -> None:
    """Qwen3-VL re-injects vision features into the image tokens' hidden states in its first
    layers. They belong to the chunk (no antecedent, no position), so the canonical is computed
    with them; leaving them out would change the chunk's KV after the first injection."""
    from tests.tiny_models import tiny_qwen3_vl

    backend = TransformersBackend(
        sharpen(tiny_qwen3_vl()), tokenizer=tiny_tokenizer(), image_processor=tiny_image_processor("qwen3_vl")
    )
    assert backend.parts.takes_deepstack
    chunk = backend.encoder.image(images(1, seed=16)[0])
    features = backend.vision_features(chunk)
    assert any(name.startswith("deepstack.") for name in features)
    with_deepstack = backend.encode(chunk)
    backend.parts = backend.parts.__class__(**{**backend.parts.__dict__, "takes_deepstack": False})
    backend.store = ChunkStore(fingerprint=backend.fingerprint, memory_budget=1 << 24)
    without = backend.encode(chunk)
    assert not torch.allclose(with_deepstack.keys, without.keys, atol=1e-4)
