"""A store that can tell a forger: signed entries on disk and on a live Valkey server.

The attack (issue 35): anyone who can write to the shared server or the disk directory takes
chunk A's canonical, re-addresses it as chunk B's, fixes up the sha256, and every process
served it as B's KV. Each test forges exactly that and checks that a store without a secret
is fooled (so the test can fail) while one with the secret refuses the entry, by the same read
path windows and engine adapters use (`WindowConfig.open_store`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from kamera_agent.config import WindowConfig
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import ChunkStore, EntryKey
from kamera_agent.store.codec import deserialize, serialize
from kamera_agent.store.remote.framing import entry_name, frame, read_head
from kamera_agent.store.signing import Signer

FP = "f" * 64
SECRET, OLD = "deployment secret", "last month's secret"


def _kv(key: str, seed: int) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(
        torch.randn(4, 2, 24, 16, generator=g), torch.randn(4, 2, 24, 16, generator=g), None, key, FP
    )


def _forged_b(payload_of_a: bytes) -> bytes:
    """A's entry re-addressed as B's (its MAC, if any, carried over): what a forger writes."""
    _, value, fingerprint = deserialize(payload_of_a)
    assert isinstance(value, ChunkKV)
    forged = ChunkKV(value.keys, value.values, None, "b", fingerprint)
    return serialize(EntryKey.canonical("b"), forged, fingerprint)


def test_a_signer_verifies_its_own_and_previous_secrets_and_never_prints_them() -> None:
    new, rolled = Signer(SECRET.encode()), Signer(SECRET.encode(), (OLD.encode(),))
    old = Signer(OLD.encode())
    mac = old.sign("digest")
    assert old.verifies("digest", mac) and rolled.verifies("digest", mac) and not new.verifies("digest", mac)
    assert not old.verifies("other digest", mac)
    assert SECRET not in repr(rolled) and OLD not in repr(rolled)
    assert SECRET not in repr(WindowConfig(store_secret=SECRET))
    with pytest.raises(ValueError, match="empty"):
        Signer(b"")


# -- disk -------------------------------------------------------------------------------------


def _disk_store(path: Path, secret: str | None) -> ChunkStore:
    return ChunkStore(fingerprint=FP, memory_limit=1 << 30, disk_dir=path, disk_limit=1 << 30, secret=secret)


def _forge_on_disk(path: Path) -> None:
    """Replace B's file by A's entry re-addressed as B's, its name's sha256 fixed up."""
    a_key, b_key = EntryKey.canonical("a"), EntryKey.canonical("b")
    (a_file,) = path.glob(f"canonical-{a_key.digest}.*.safetensors")
    (b_file,) = path.glob(f"canonical-{b_key.digest}.*.safetensors")
    blob = _forged_b(a_file.read_bytes())
    b_file.unlink()
    (path / f"canonical-{b_key.digest}.{hashlib.sha256(blob).hexdigest()}.safetensors").write_bytes(blob)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_forged_disk_entry_is_refused_with_a_secret_and_served_without(
    tmp_path: Path, secret: str | None
) -> None:
    a, b = _kv("a", 1), _kv("b", 2)
    with _disk_store(tmp_path, secret) as writer:
        writer.put_canonical(a)
        writer.put_canonical(b)
    _forge_on_disk(tmp_path)
    with _disk_store(tmp_path, secret) as reader:
        got = reader.get_canonical("b")
        if secret is None:  # the forgery works on an unsigned store: this test can fail
            assert got is not None and torch.equal(got.keys, a.keys)
        else:
            assert got is None and reader.stats().unsigned_refused == 1
            assert torch.equal(reader.get_canonical("a").keys, a.keys)  # type: ignore[union-attr]


def test_unsigned_entries_are_refused_once_a_secret_is_set(tmp_path: Path) -> None:
    with _disk_store(tmp_path, None) as writer:
        writer.put_canonical(_kv("a", 1))
    with _disk_store(tmp_path, SECRET) as reader:
        assert reader.get_canonical("a") is None and reader.stats().unsigned_refused == 1
    assert list(tmp_path.glob("canonical-*"))  # refused, not deleted: another secret may sign it


# -- the shared tier --------------------------------------------------------------------------


def _remote(url: str, secret: str | None = None, previous: tuple[str, ...] = ()) -> ChunkStore:
    return ChunkStore(
        fingerprint=FP, memory_limit=1 << 30, remote=url, secret=secret, previous_secrets=previous
    )


def _forge_on_server(url: str) -> None:
    import valkey

    client = valkey.Valkey.from_url(url)
    a_name, b_name = (entry_name("kam", FP, EntryKey.canonical(k)) for k in ("a", "b"))
    head = client.get(a_name)
    assert isinstance(head, bytes)
    _, inline = read_head(head)
    assert inline, "the test entries fit one value"
    blob = _forged_b(inline)
    client.set(b_name, frame(EntryKey.canonical("b"), FP, blob, 1 << 20)[1])


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_forged_shared_entry_is_refused_by_every_reader_with_the_secret(
    store_url: str, secret: str | None
) -> None:
    a = _kv("a", 1)
    writer = _remote(store_url, secret)
    writer.put_canonical(a)
    writer.put_canonical(_kv("b", 2))
    writer.flush()
    writer.close()
    _forge_on_server(store_url)
    config = WindowConfig(store_url=store_url, store_secret=secret)
    for reader in (_remote(store_url, secret), config.open_store(FP)):  # a window's and an engine's store
        got = reader.get_canonical("b")
        if secret is None:
            assert got is not None and torch.equal(got.keys, a.keys)
        else:
            assert got is None and reader.stats().unsigned_refused == 1
            assert reader.get_canonical("a") is not None  # what was signed is served
        reader.close()


def test_rotation_reads_the_old_secrets_entries_and_refuses_them_without_it(store_url: str) -> None:
    writer = _remote(store_url, OLD)
    writer.put_canonical(_kv("a", 1))
    writer.flush()
    writer.close()
    rolled, moved_on = _remote(store_url, SECRET, (OLD,)), _remote(store_url, SECRET)
    assert rolled.get_canonical("a") is not None and rolled.stats().remote_hits == 1
    assert moved_on.get_canonical("a") is None and moved_on.stats().unsigned_refused == 1
    rolled.close()
    moved_on.close()


def test_the_secrets_come_from_the_environment_when_the_settings_name_none(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAMERA_STORE_SECRET", SECRET)
    monkeypatch.setenv("KAMERA_STORE_PREVIOUS_SECRETS", f"{OLD},another")
    store = _remote(store_url)
    signer = store._stack.signer
    assert signer is not None and signer.secret == SECRET.encode() and len(signer.previous) == 2
    store.close()
