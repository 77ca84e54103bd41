"""Entries of an older entry format are refused by name, never decoded: on disk and on the shared tier.

The engineer who bumps `codec.FORMAT` changes what keys and states mean, so an entry written
before must never be served. Each test writes entries as an older kamera-agent would (the
format string patched while writing), then opens a store of this version: nothing is served,
the reason names the format found and the one expected, and the entry can be computed again.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
import torch

from kamera_agent.store import ChunkStore, EntryKey, codec
from kamera_agent.store.codec import FORMAT, OutdatedEntry, deserialize, header_of, serialize
from kamera_agent.store.remote import framing
from tests.store.test_chunk_store import FP, make_kv, make_patch

OLD = "kamera-store/3"
STATE = "s" * 64


def test_the_format_is_4_and_a_decode_of_another_names_both() -> None:
    assert FORMAT == "kamera-store/4"
    key = EntryKey.canonical("page")
    for written, age in ((OLD, "an older"), ("kamera-store/9", "a newer")):
        with pytest.MonkeyPatch.context() as patched:
            patched.setattr(codec, "FORMAT", written)
            blob = serialize(key, make_kv("page", 3), FP)
        assert header_of(blob)["format"] == written
        named = rf"{age} kamera-agent entry format \({written}\); this version reads {FORMAT}"
        with pytest.raises(OutdatedEntry, match=named):
            deserialize(blob)
    deserialize(serialize(key, make_kv("page", 3), FP))  # this version's own bytes decode


# --- disk ---------------------------------------------------------------------------------


def _store(directory: Path) -> ChunkStore:
    return ChunkStore(fingerprint=FP, memory_limit=1 << 20, disk_dir=directory, disk_limit=1 << 20)


def _write_old(directory: Path) -> None:
    """A canonical and a patch on disk, in the older format (its index says so too)."""
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(codec, "FORMAT", OLD)
        with _store(directory) as store:
            store.put_canonical(make_kv("page", 4))
            store.put_patch(make_patch("page", STATE, 4, 2))
    assert len(list(directory.glob("*.safetensors"))) == 2


def _edit_index(directory: Path, index: str) -> None:
    if index == "deleted":
        for path in directory.glob("index.sqlite*"):
            path.unlink()
        return
    if index == "as written":
        return
    # "older": an index whose records name no format; "claims current": a lying index (the file
    # itself is read at the first use)
    with sqlite3.connect(directory / "index.sqlite") as db:
        db.execute("UPDATE files SET format=?", ("" if index == "older" else FORMAT,))


@pytest.mark.parametrize("index", ["as written", "deleted", "older", "claims current"])
def test_an_older_format_on_disk_is_dropped_by_name_and_recomputed(
    tmp_path: Path, index: str, caplog: pytest.LogCaptureFixture
) -> None:
    _write_old(tmp_path)
    _edit_index(tmp_path, index)
    caplog.set_level(logging.WARNING, logger="kamera_agent.store.disk")
    with _store(tmp_path) as store:
        assert store.get_canonical("page") is None  # never served
        assert store.patch_info("page", STATE) is None and store.get_patch("page", STATE) is None
        stats = store.stats()
        assert (stats.outdated_dropped, stats.corrupt_dropped, stats.disk_hits, stats.lost) == (2, 0, 0, 2)
        assert not list(tmp_path.glob("*.safetensors"))  # deleted, not left to be misread later
        events = store.events()
        assert [event.kind for event in events] == ["outdated", "outdated"] and all(e.lost for e in events)
        for detail in [event.detail for event in events] + [r.getMessage() for r in caplog.records]:
            assert f"older kamera-agent entry format ({OLD}); this version reads {FORMAT}" in detail
            assert "recomputes the entry" in detail
        kv = make_kv("page", 4, seed=5)  # the caller computes it again; the store takes it
        store.put_canonical(kv)
        got = store.get_canonical("page")
        assert got is not None and torch.equal(got.keys, kv.keys)
    with _store(tmp_path) as reopened:  # this version's file is served after a reopen
        assert reopened.get_canonical("page") is not None and reopened.stats().outdated_dropped == 0


# --- the shared tier --------------------------------------------------------------------


def _old_info(payload: bytes) -> dict[str, str]:
    """What an older kamera-agent put in a head: a patch's fields, no entry format."""
    meta = header_of(payload)
    fields = ("state", "meta", "num_tokens", "patch_kind")
    return {name: meta[name] for name in fields if meta.get("kind") == "patch" and name in meta}


@pytest.mark.parametrize("head", ["names its format", "from an older kamera"])
def test_an_older_format_on_the_shared_tier_is_rejected_by_name(
    store_url: str, head: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(codec, "FORMAT", OLD)
        if head == "from an older kamera":
            patched.setattr(framing, "_info", _old_info)
        writer = ChunkStore(fingerprint=FP, memory_limit=1 << 20, remote=store_url + "?part_bytes=1024")
        writer.put_canonical(make_kv("page", 8))  # 4 KiB of tensors: a head and parts
        writer.put_patch(make_patch("page", STATE, 4, 2))
        writer.close()  # the queued writes are encoded (in the old format) and written
    assert writer.stats().remote_writes == 2
    caplog.set_level(logging.WARNING, logger="kamera_agent.store.remote")

    reader = ChunkStore(fingerprint=FP, memory_limit=1 << 20, remote=store_url)
    assert reader.get_canonical("page") is None  # the get path: never decoded as this format
    assert reader.patch_info("page", STATE) is None  # the peek path: no stale state for a planner
    assert reader.get_patch("page", STATE) is None
    stats = reader.stats()
    assert (stats.remote_hits, stats.remote_rejected, stats.unavailable) == (0, 2, 0)
    messages = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(messages) == 2 and all("older kamera-agent entry format" in m for m in messages)
    assert all(f"this version reads {FORMAT} and recomputes the entry" in m for m in messages)
    assert f"({OLD})" in messages[0]  # the canonical's payload (or head) names its format
    reader.put_canonical(make_kv("page", 8, seed=5))  # computed again, shared again
    reader.close()
    fresh = ChunkStore(fingerprint=FP, memory_limit=1 << 20, remote=store_url)
    got = fresh.get_canonical("page")
    assert got is not None and torch.equal(got.keys, make_kv("page", 8, seed=5).keys)
    fresh.close()
