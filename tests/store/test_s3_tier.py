"""The S3 tier against a real local S3 server (moto in server mode, on 127.0.0.1): entries
written by one store are served to another, checked like the Valkey tier's (sha256, address,
model, the store's MAC), and a bucket that is unreachable or never answers costs a lookup at
most its deadline, then nothing while it is skipped."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import replace

import boto3
import pytest

from kamera_agent.store import ChunkStore
from kamera_agent.store.deadlines import DeadlineBounds
from kamera_agent.store.s3 import parse_s3_url
from tests.store.test_chunk_store import FP, make_kv

FAST = DeadlineBounds(factor=1.0, floor=0.3, ceiling=0.6)


def _store(url: str, secret: str | None = None) -> ChunkStore:
    return ChunkStore(fingerprint=FP, memory_limit=1 << 24, urls=[url], secret=secret, deadlines=FAST)


def _objects(url: str) -> dict[str, bytes]:
    address = parse_s3_url(url)
    client = boto3.client("s3", endpoint_url=address.endpoint, region_name="us-east-1")
    listed = client.list_objects_v2(Bucket=address.bucket).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=address.bucket, Key=o["Key"])["Body"].read() for o in listed}


def _overwrite(url: str, name: str, body: bytes) -> None:
    address = parse_s3_url(url)
    client = boto3.client("s3", endpoint_url=address.endpoint, region_name="us-east-1")
    client.put_object(Bucket=address.bucket, Key=name, Body=body)


def test_an_entry_one_store_writes_another_reads(s3_url: str) -> None:
    kv = make_kv("a", 12)
    with _store(s3_url) as writer:
        writer.put_canonical(kv)
        writer.flush()
        assert writer.stats().tiers["s3"].puts == 1
    assert [name.split("/", 1)[0] for name in _objects(s3_url)] == ["cache"]  # the URL's prefix
    with _store(s3_url) as reader:
        got = reader.get_canonical("a")
        assert got is not None and all(a.equal(b) for a, b in zip(got.keys, kv.keys, strict=True))
        assert reader.has_canonical("a") and reader.get_canonical("missing") is None
        tier = reader.stats().tiers["s3"]
    assert (tier.hits, tier.misses, tier.unavailable, tier.errors) == (1, 1, 0, 0)
    assert tier.bytes_read > kv.nbytes and tier.get_seconds > 0 and tier.report["up"] == 1.0


def test_a_damaged_object_is_deleted_never_served(s3_url: str) -> None:
    with _store(s3_url) as writer:
        writer.put_canonical(make_kv("a", 12))
        writer.flush()
    [(name, body)] = _objects(s3_url).items()
    _overwrite(s3_url, name, body[:-1] + bytes([body[-1] ^ 1]))  # one bit of the payload flipped
    with _store(s3_url) as reader:
        assert reader.get_canonical("a") is None
        assert reader.stats().tiers["s3"].rejected == 1
    assert _objects(s3_url) == {}


def test_entries_are_signed_and_a_foreign_secret_is_refused(s3_url: str) -> None:
    with _store(s3_url, secret="ours") as writer:
        writer.put_canonical(make_kv("a", 12))
        writer.flush()
    with _store(s3_url, secret="theirs") as stranger:
        assert stranger.get_canonical("a") is None
        assert stranger.stats().unsigned_refused == 1
    with _store(s3_url, secret="ours") as reader:
        assert reader.get_canonical("a") is not None


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never answers (a hung server)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("server", ["silent", "closed"])
def test_a_lost_bucket_never_stalls_a_lookup(server: str, silent_port: int) -> None:
    port = silent_port if server == "silent" else _closed_port()
    url = f"s3://kam-lost/cache?endpoint=http://127.0.0.1:{port}&timeout=0.5&backoff=30"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        store = _store(url)
    began = time.monotonic()
    assert store.get_canonical("a") is None  # one call, cut at its deadline at most
    first = time.monotonic() - began
    began = time.monotonic()
    for _ in range(20):  # skipped while the bucket is away: no call at all
        assert store.get_canonical("a") is None and not store.has_canonical("a")
        store.put_canonical(make_kv("b", 4))  # queued: a put never waits for the bucket
    rest = time.monotonic() - began
    stats = store.stats()
    store.close()  # the queued writes fail fast while the bucket is skipped
    assert first < FAST.ceiling + 0.3 and rest < 0.5 and time.monotonic() - began < 2
    assert (
        stats.tiers["s3"].unavailable == 41
        and stats.unavailable == 41
        and stats.tiers["s3"].report["up"] == 0.0
    )


def test_the_store_command_counts_and_clears_a_buckets_entries(
    s3_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kamera_agent.cli import main

    other_fp = "f" * 64
    for fingerprint, keys in ((FP, "ab"), (other_fp, "a")):  # default deadlines: every write lands
        with ChunkStore(fingerprint=fingerprint, memory_limit=1 << 24, urls=[s3_url]) as store:
            for key in keys:
                store.put_canonical(replace(make_kv(key, 12), model_fingerprint=fingerprint))
            store.flush()
            assert store.stats().tiers["s3"].report["writes"] == len(keys)
    _overwrite(s3_url, "cache/notes.txt", b"another owner's object")

    assert main(["store", "stats", "--url", s3_url]) == 0
    out = capsys.readouterr().out
    assert "canonical" in out and f"{FP[:16]}… 2" in out and "ffffffffffffffff… 1" in out, out
    assert "1 other objects" in out
    assert main(["store", "clear", "--url", s3_url]) == 2  # asks for --yes first
    assert main(["store", "clear", "--url", s3_url, "--model", other_fp, "--yes"]) == 0
    assert "removed 1 keys" in capsys.readouterr().out
    assert main(["store", "clear", "--url", s3_url, "--yes"]) == 0
    assert "removed 2 keys" in capsys.readouterr().out, list(_objects(s3_url))
    assert list(_objects(s3_url)) == ["cache/notes.txt"]  # what is not kamera's stays
    gone = s3_url.replace("endpoint=http://127.0.0.1:", "endpoint=http://127.0.0.1:1").split("&")[0]
    assert main(["store", "stats", "--url", gone]) == 1
    assert "did not answer" in capsys.readouterr().out
