"""Where the shared store lives and how kamera talks to it: a parsed ``store_url``.

Why one URL: a deployment sets one variable (``KAMERA_STORE_URL``) on every worker and node,
so the URL carries every remote setting; nothing else has to agree between processes.

    redis://[user:password@]host[:port][/db][?option=value&...]     one server
    valkey://...   (the same)        rediss:// valkeys://   (TLS)
    redis+cluster://host:port[,host:port...][?...]                   a cluster: any nodes, it finds the rest
    valkey+cluster://...   rediss+cluster://...   valkeys+cluster://...

Options: ``timeout`` seconds per call to start with (0.2), ``max_timeout`` the most it adapts
to when a healthy server answers slowly (2.0), ``ttl`` seconds an entry lives (604800, a week;
0: until the server's eviction policy takes it), ``part_bytes`` the largest value written as
one key (4 MiB), ``pending_bytes`` the most bytes waiting to be written in the background
(256 MiB; a write beyond it is skipped and counted), ``prefix`` of every key (``kam``).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

from kamera_agent.errors import StoreURLError

__all__ = ["RemoteAddress", "parse_store_url"]

_SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True}
_DEFAULT_PORT = 6379


@dataclass(frozen=True)
class RemoteAddress:
    """A parsed store URL (``parse_store_url``); ``str()`` gives it back without the password.

    Attributes:
        nodes: ``(host, port)`` of the server, or the cluster's seed nodes.
        cluster: the nodes form a cluster (keys are routed by hash slot).
        tls: connect over TLS.
        db: the database number (standalone only; a cluster has one).
        username / password: credentials, if any.
        timeout: seconds one call may take before it counts as failed, to start with.
        max_timeout: the longest the timeout grows to while the server answers, but slowly (a
            busy machine): a call that times out then raises the timeout instead of declaring
            the server down.
        ttl: seconds each entry lives; 0 leaves expiry to the server's maxmemory policy.
        part_bytes: values larger than this are split into parts of at most this size.
        pending_bytes: most bytes queued for background writes.
        prefix: the first segment of every key this store writes.
    """

    nodes: tuple[tuple[str, int], ...]
    cluster: bool = False
    tls: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = None
    timeout: float = 0.2
    max_timeout: float = 2.0
    ttl: int = 7 * 24 * 3600
    part_bytes: int = 4 << 20
    pending_bytes: int = 256 << 20
    prefix: str = "kam"

    def __str__(self) -> str:
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        user = f"{self.username or ''}:***@" if self.password else ""
        hosts = ",".join(f"{host}:{port}" for host, port in self.nodes)
        return f"{scheme}://{user}{hosts}" + ("" if self.cluster else f"/{self.db}")


def parse_store_url(url: str) -> RemoteAddress:
    """The `RemoteAddress` a ``store_url`` names.

    Raises:
        StoreURLError: an unknown scheme, no host, a bad port, database or option.
    """
    scheme, sep, rest = url.partition("://")
    base, plus, mode = scheme.lower().partition("+")
    if not sep or base not in _SCHEMES or (plus and mode != "cluster"):
        raise StoreURLError(
            f"store_url {_safe(url)!r} has no scheme kamera can use; write redis://host:6379/0, "
            "valkey://host:6379/0, rediss:// for TLS, or redis+cluster://host:port,host:port for a cluster"
        )
    netloc, _, tail = _split_netloc(rest)
    path, _, query = tail.partition("?")
    userinfo, at, hosts = netloc.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    nodes = tuple(_node(part, url) for part in hosts.split(",") if part)
    if not nodes:
        raise StoreURLError(f"store_url {_safe(url)!r} names no host; e.g. redis://127.0.0.1:6379/0")
    cluster = bool(plus)
    if len(nodes) > 1 and not cluster:
        raise StoreURLError(
            f"store_url {_safe(url)!r} lists {len(nodes)} hosts for one server; use "
            f"{base}+cluster://... for a cluster, or name one host"
        )
    db = _db(path.strip("/"), url, cluster)
    options = _options(query, url)
    return RemoteAddress(
        nodes,
        cluster,
        _SCHEMES[base],
        db,
        username,
        password,
        **options,  # type: ignore[arg-type]
    )


def _split_netloc(rest: str) -> tuple[str, str, str]:
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    return rest[:cut], "", rest[cut:]


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    if not colon:  # redis://password@host is the common short form
        return None, unquote(user) or None
    return unquote(user) or None, unquote(password) or None


def _node(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:6379
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    port = port or str(_DEFAULT_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StoreURLError(f"store_url {_safe(url)!r}: {text!r} is not host:port (port 1-65535)")
    return host, int(port)


def _db(path: str, url: str, cluster: bool) -> int:
    if not path:
        return 0
    if cluster or not path.isdigit():
        why = "a cluster has only database 0" if cluster else f"{path!r} is not a database number"
        raise StoreURLError(f"store_url {_safe(url)!r}: {why}")
    return int(path)


_NUMBERS = {"timeout": float, "max_timeout": float, "ttl": int, "part_bytes": int, "pending_bytes": int}


def _options(query: str, url: str) -> dict[str, float | int | str]:
    options: dict[str, float | int | str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "prefix":
            if not value or any(c in value for c in "{}: "):
                raise StoreURLError(
                    f"store_url {_safe(url)!r}: prefix must be non-empty, without {{}}: or spaces"
                )
            options[name] = value
            continue
        if name not in _NUMBERS:
            known = ", ".join(sorted([*_NUMBERS, "prefix"]))
            raise StoreURLError(f"store_url {_safe(url)!r}: unknown option {name!r}; known: {known}")
        try:
            number = _NUMBERS[name](value)
        except ValueError:
            raise StoreURLError(f"store_url {_safe(url)!r}: {name}={value!r} is not a number") from None
        if number < 0 or (number == 0 and name != "ttl"):
            raise StoreURLError(f"store_url {_safe(url)!r}: {name} must be positive (ttl may be 0)")
        options[name] = number
    return options


def _safe(url: str) -> str:
    """The URL with any password masked (errors and logs never print one)."""
    scheme, sep, rest = url.partition("://")
    netloc, _, tail = _split_netloc(rest)
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        return url
    user = userinfo.partition(":")[0] if ":" in userinfo else ""
    return f"{scheme}{sep}{user}:***@{hosts}{tail}"
