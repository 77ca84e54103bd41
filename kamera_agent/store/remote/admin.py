"""What a shared store holds, and emptying it: ``kamera store stats|clear``.

Why a scan of our own keys: the server's ``INFO`` counts every key of every user of the
server; an operator sizing the store needs kamera's entries by kind and by model, and the
server's memory limit and eviction policy beside them (entries are only ever lost to those,
or to their TTL). Scans are cursor-based (``SCAN``), so a large store is never blocked.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from kamera_agent.store.remote.address import RemoteAddress
from kamera_agent.store.remote.connection import Connection
from kamera_agent.store.usage import TierUsage

__all__ = ["RemoteUsage", "clear", "usage"]

_BATCH = 512
_ADMIN_TIMEOUT = 10.0  # a scan batch may take longer than an op's lookup


@dataclass
class RemoteUsage(TierUsage):
    """kamera's entries on a shared store (``usage``), with the server's memory settings.

    Attributes:
        server: the server's ``used_memory``, ``maxmemory``, ``maxmemory_policy`` (first node).
    """

    server: dict[str, Any] = field(default_factory=dict)


def usage(address: RemoteAddress, model: str | None = None) -> RemoteUsage:
    """Count kamera's entries (of ``model`` only, when given) and their bytes.

    Raises:
        RemoteUnavailable: the server did not answer.
    """
    connection = Connection(replace(address, timeout=max(address.timeout, _ADMIN_TIMEOUT)))
    found = RemoteUsage()
    try:
        for batch in _scan(connection, address.prefix, model):
            sizes = connection.call(partial(_strlen_all, names=batch))
            for name, size in zip(batch, sizes, strict=True):
                fingerprint, kind, is_part = _parse(name)
                found.nbytes[kind] += int(size)
                if is_part:
                    found.parts += 1
                else:
                    found.entries[kind] += 1
                    found.models[fingerprint] += 1
        found.server = _server_memory(address)
        found.notes.append(
            f"server: used_memory {found.server.get('used_memory')} bytes, maxmemory "
            f"{found.server.get('maxmemory')} (0: unlimited), policy {found.server.get('maxmemory_policy')}"
        )
    finally:
        connection.close()
    return found


def clear(address: RemoteAddress, model: str | None = None) -> int:
    """Delete kamera's entries (of ``model`` only, when given); returns how many keys went.

    Raises:
        RemoteUnavailable: the server did not answer.
    """
    connection = Connection(replace(address, timeout=max(address.timeout, _ADMIN_TIMEOUT)))
    removed = 0
    try:
        for batch in _scan(connection, address.prefix, model):
            connection.call(partial(_unlink_all, names=batch))
            removed += len(batch)
    finally:
        connection.close()
    return removed


def _server_memory(address: RemoteAddress) -> dict[str, Any]:
    """The memory limit and eviction policy of the first node (a cluster's nodes share them)."""
    node = replace(
        address, cluster=False, nodes=address.nodes[:1], timeout=max(address.timeout, _ADMIN_TIMEOUT)
    )
    connection = Connection(node)
    try:
        info = connection.call(lambda client: client.info("memory"))
    finally:
        connection.close()
    return {name: info.get(name) for name in ("used_memory", "maxmemory", "maxmemory_policy")}


def _scan(connection: Connection, prefix: str, model: str | None) -> list[list[str]]:
    pattern = f"{prefix}:{{{model}:*" if model else f"{prefix}:{{*"

    def scan(client: Any) -> list[str]:
        if connection.address.cluster:
            from valkey.cluster import ValkeyCluster

            names = client.scan_iter(match=pattern, count=_BATCH, target_nodes=ValkeyCluster.PRIMARIES)
        else:
            names = client.scan_iter(match=pattern, count=_BATCH)
        return sorted({name.decode() if isinstance(name, bytes) else str(name) for name in names})

    names = connection.call(scan)
    return [names[i : i + _BATCH] for i in range(0, len(names), _BATCH)]


def _parse(name: str) -> tuple[str, str, bool]:
    """``(fingerprint, kind, is a part)`` of one of our key names."""
    tag, _, rest = name.partition("{")[2].partition("}")
    fingerprint = tag.partition(":")[0]
    fields = rest.lstrip(":").split(":")
    return fingerprint, fields[0], "part" in fields[1:]


def _strlen_all(client: Any, names: list[str]) -> list[int]:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.strlen(name)
    return [int(size) for size in pipe.execute()]


def _unlink_all(client: Any, names: list[str]) -> None:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.unlink(name)
    pipe.execute()
