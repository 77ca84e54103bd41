"""The engine-neutral core over a store: counted hits, rebuilds from stored vision, reloads, foreign models.

Costs come from what each primitive reports (`Txn.meter`), never from backend side effects.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kamera_agent.backends import TransformersBackend
from kamera_agent.core import KVCore
from kamera_agent.errors import ForeignChunkError
from kamera_agent.store import ChunkStore
from tests.backends.test_transformers_backend import images, sharpen
from tests.tiny_models import tiny_qwen2_5_vl, tiny_qwen2_vl
from tests.tiny_processors import tiny_image_processor, tiny_tokenizer


def _backend(model: object | None = None) -> TransformersBackend:
    model = model or sharpen(tiny_qwen2_vl())
    return TransformersBackend(
        model, tokenizer=tiny_tokenizer(), image_processor=tiny_image_processor("qwen2_vl")
    )


def _core(backend: TransformersBackend, store: ChunkStore | None = None) -> KVCore:
    return KVCore(backend, store or ChunkStore(fingerprint=backend.fingerprint, memory_limit=1 << 24))


def test_an_image_the_store_holds_runs_no_vision_and_no_lm_forward() -> None:
    core = _core(_backend())
    chunk = core.backend.encoder.image(images(1, seed=11)[0])
    with core.txn() as txn:
        first = core.canonical(chunk, txn)
    txn = core.txn()
    again = core.canonical(core.backend.encoder.image(images(1, seed=11)[0]), txn)  # a new Chunk object
    assert (txn.meter.spent.forwards, txn.meter.spent.vision_encodes) == (0, 0)
    assert torch.equal(again.keys, first.keys) and torch.equal(again.values, first.values)


def test_a_canonical_evicted_from_the_store_is_rebuilt_without_the_vision_tower() -> None:
    backend = _backend()
    core = _core(backend)
    chunk = backend.encoder.image(images(1, seed=12)[0])
    with core.txn() as txn:
        canonical = core.canonical(chunk, txn)
    vision = core.store.get_vision(chunk.vision_key)  # type: ignore[arg-type]
    assert vision is not None
    vision_bytes = sum(t.numel() * t.element_size() for t in vision.values())
    # A store that holds the vision output and one canonical; largest-first evicts canonicals.
    small = ChunkStore(
        fingerprint=backend.fingerprint, memory_limit=vision_bytes + canonical.nbytes, policy="largest_first"
    )
    small.put_vision(chunk.vision_key, vision)  # type: ignore[arg-type]
    small.put_canonical(canonical)
    core = _core(backend, small)
    with core.txn() as txn:
        core.canonical(backend.encoder.text("abcd"), txn)  # 4 tokens: pushes the larger image canonical out
    assert small.get_canonical(chunk.key) is None and small.stats().dropped >= 1
    txn = core.txn()
    rebuilt = core.canonical(chunk, txn)
    assert (txn.meter.spent.vision_encodes, txn.meter.spent.forwards) == (0, 1)
    torch.testing.assert_close(rebuilt.keys, canonical.keys)


def test_a_new_process_on_the_same_directory_reloads_the_disk_tier(tmp_path: Path) -> None:
    backend = _backend()

    def store() -> ChunkStore:
        return ChunkStore(
            fingerprint=backend.fingerprint, memory_limit=1 << 24, disk_dir=tmp_path, disk_limit=1 << 24
        )

    first = _core(backend, store())
    chunk = backend.encoder.image(images(1, seed=13)[0])
    with first.txn() as txn:
        canonical = first.canonical(chunk, txn)
    first.store.flush()
    first.store.close()
    second = _core(backend, store())
    txn = second.txn()
    again = second.canonical(backend.encoder.image(images(1, seed=13)[0]), txn)
    assert txn.meter.spent.forwards == 0
    assert again.keys.device == backend.device  # moved from the disk tier's CPU copy
    assert torch.equal(again.keys, canonical.keys)


def test_a_core_refuses_another_models_store_and_a_foreign_chunk() -> None:
    backend, other = _backend(), _backend(sharpen(tiny_qwen2_5_vl()))
    with pytest.raises(ForeignChunkError, match="another model"):
        KVCore(backend, ChunkStore(fingerprint=other.fingerprint, memory_limit=1 << 20))
    foreign = other.encoder.image(images(1, seed=14)[0])
    core = _core(backend)
    with pytest.raises(ForeignChunkError, match="another model or processor"):
        core.canonical(foreign, core.txn())


def test_a_failed_transaction_stores_nothing() -> None:
    core = _core(_backend())
    chunk = core.backend.encoder.image(images(1, seed=17)[0])
    with pytest.raises(RuntimeError), core.txn() as txn:
        core.canonical(chunk, txn)
        assert txn.store.pending == 2  # the vision output and the canonical, staged
        raise RuntimeError("the op failed after its prefill")
    assert core.store.keys() == [] and core.store.stats().puts == 0


def test_entries_larger_than_the_budget_are_used_uncached_and_counted() -> None:
    backend = _backend()
    core = _core(backend, ChunkStore(fingerprint=backend.fingerprint, memory_limit=512))
    chunk = backend.encoder.text("a text long enough that its canonical exceeds five hundred bytes")
    with core.txn() as txn:
        core.canonical(chunk, txn)
    assert txn.meter.counts["uncached"] == 1 and core.store.keys() == []


def test_a_corrupted_spill_file_is_dropped_and_the_chunk_re_encoded(tmp_path: Path) -> None:
    backend = _backend()

    def store() -> ChunkStore:
        return ChunkStore(
            fingerprint=backend.fingerprint, memory_limit=1 << 24, disk_dir=tmp_path, disk_limit=1 << 24
        )

    core = _core(backend, store())
    chunk = backend.encoder.text("a page the disk tier will damage")
    with core.txn() as txn:
        canonical = core.canonical(chunk, txn)
    core.store.flush()
    core.store.close()
    (spilled,) = tmp_path.glob("canonical-*.safetensors")
    data = bytearray(spilled.read_bytes())
    data[len(data) // 2] ^= 0xFF
    spilled.write_bytes(bytes(data))
    reopened = _core(backend, store())
    txn = reopened.txn()
    reopened.anchor_kv(txn.meter)
    before = txn.meter.spent.forwards
    rebuilt = reopened.canonical(chunk, txn)
    assert txn.meter.spent.forwards - before == 1  # re-encoded, never served corrupt
    assert reopened.store.stats().corrupt_dropped == 1
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
    features = backend.encode_vision(chunk).features
    assert any(name.startswith("deepstack.") for name in features)
    core = _core(backend)
    with_deepstack = core.canonical(chunk, core.txn())
    backend.parts = dataclasses.replace(backend.parts, takes_deepstack=False)
    core = _core(backend)
    without = core.canonical(chunk, core.txn())
    assert not torch.allclose(with_deepstack.keys, without.keys, atol=1e-4)
