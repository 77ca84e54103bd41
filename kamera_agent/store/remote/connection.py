"""A bounded connection to Valkey/Redis that fails fast and backs off while the server is away.

Why: the remote tier is an optimisation under a store that already works alone. A call that
hangs, or an exception from a dead server reaching a window op, would make the shared store a
liability. So every call has a timeout and no client-side retries; a failure opens a breaker
that skips the server for a while (0.25 s, doubling to 30 s), and the first call after that
tries again: a restarted server is picked up without anyone asking. The tier says so once per
outage (a log warning), and once when the server is back.

The timeout adapts: it starts at the URL's ``timeout`` (0.2 s). A call that *times out* on a
server that answered before is a slow server, not a dead one (a starved CPU, a burst of large
values): the call fails, but instead of declaring an outage the timeout doubles, up to
``max_timeout`` (2 s); only a timeout at that ceiling, or a refused or broken connection, opens
the breaker. While calls answer well within it, the timeout decays back toward the URL's.

A call may also carry a total deadline (`kamera_agent.store.deadlines`): its sockets wait at most
until then (`bounded`), and a call cut there fails with `DeadlineMissed`, which is no outage and
no slowness of the timeout's kind (the server may be fine, only too slow for this entry). Three
in a row are a server too slow to be worth asking: it is skipped for a while (2 s), then asked
again; each call cut after that skips it again for twice as long (to 60 s) until one is on
time, so that ops run at local speed.

Client: valkey-py (``valkey`` on PyPI), the Valkey project's own fork of redis-py: the same
API for Valkey and Redis servers, a cluster client that routes by hash slot, and pipelines.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kamera_agent.errors import SettingsError
from kamera_agent.store.remote import bounded
from kamera_agent.store.remote.address import RemoteAddress

__all__ = ["Connection", "DeadlineMissed", "RemoteUnavailable"]

_LOG = logging.getLogger("kamera_agent.store.remote")
_QUICK_CALLS = 64  # calls within a quarter of the timeout before it steps back down
SLOW_AFTER = 3
"""Calls in a row cut at their deadline before the server is skipped for a while."""
SLOW_PAUSE = (2.0, 60.0)
"""Seconds a server too slow for its deadlines is skipped: the first pause, and the longest
(doubling while each call after a pause is cut again). A slow link heals slower than a
restarted server, and every call that tries it costs an op its deadline."""
T = TypeVar("T")


class RemoteUnavailable(Exception):
    """The server did not answer (internal to the remote tier: never leaves the store)."""


class DeadlineMissed(RemoteUnavailable):
    """The call was abandoned at its total deadline (internal: the lookup counts a deadline miss)."""


class Connection:
    """Calls to the store's server, each bounded, behind a breaker.

    Thread-safe: valkey-py clients pool their connections; the breaker has its own lock.

    Args:
        address: where the server is.
        backoff: first pause after a failure, seconds (doubles up to ``max_backoff``).
        max_backoff: longest pause, seconds.

    Raises:
        SettingsError: the ``valkey`` client package is not installed.
    """

    def __init__(self, address: RemoteAddress, backoff: float = 0.25, max_backoff: float = 30.0) -> None:
        try:
            import valkey  # noqa: F401  (a clear error now beats one at the first call)
        except ImportError as exc:
            raise SettingsError(
                "store_url needs the valkey client: pip install 'kamera-agent[remote]'"
            ) from exc
        self.address = address
        self._backoff, self._max_backoff = backoff, max_backoff
        self._lock = threading.Lock()
        self._client: Any = None
        self._pause = backoff
        self._retry_at = 0.0
        self.down = False
        self.outages = 0
        self.timeout = address.timeout
        """The current per-call timeout (adapted between the URL's ``timeout`` and ``max_timeout``)."""
        self.slow_calls = 0
        """Calls that timed out on an answering server and raised the timeout (no outage)."""
        self._answered = False
        self._quick = 0
        self.deadline_misses = 0
        """Calls abandoned at their total deadline."""
        self._late = 0  # such calls in a row
        self._slow_until = 0.0
        self._slow_pause = SLOW_PAUSE[0]

    @property
    def slow(self) -> bool:
        """The server is skipped for now: its last calls all outlived their deadlines."""
        with self._lock:
            return time.monotonic() < self._slow_until

    def call(self, work: Callable[[Any], T], until: float | None = None) -> T:
        """``work(client)`` within the timeout and by ``until`` (``time.monotonic()`` seconds),
        or `RemoteUnavailable` (`DeadlineMissed` past ``until``; at once while backing off)."""
        from valkey.exceptions import ResponseError, ValkeyError
        from valkey.exceptions import TimeoutError as CallTimeout

        with self._lock:
            now = time.monotonic()
            if self.down and now < self._retry_at:
                raise RemoteUnavailable("backing off")
            if now < self._slow_until:
                raise RemoteUnavailable("slower than its deadlines: skipped for now")
        began = time.monotonic()
        try:
            with bounded.until(until):
                result = work(self._connected())
        except ResponseError as exc:  # it answered but refused (OOM under noeviction, WRONGTYPE):
            raise RemoteUnavailable(f"refused: {exc}") from exc  # this call fails; no outage
        except (CallTimeout, TimeoutError) as exc:
            if until is not None and (bounded.expired() or time.monotonic() >= until):
                self._late_call()
                raise DeadlineMissed(f"abandoned at its deadline ({until - began:.3g} s)") from exc
            if not self._slower():
                self._failed(exc)
            raise RemoteUnavailable(f"timed out after {self.timeout:g} s: {exc}") from exc
        except (ValkeyError, OSError) as exc:
            self._failed(exc)
            raise RemoteUnavailable(str(exc)) from exc
        self._succeeded(time.monotonic() - began)
        return result

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _connected(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        import valkey
        from valkey.backoff import NoBackoff
        from valkey.retry import Retry

        a = self.address
        common: dict[str, Any] = {  # (TLS by the connection class: as ssl=True, with its defaults)
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "retry": Retry(NoBackoff(), 0),
            "username": a.username,
            "password": a.password,
            "connection_class": bounded.connection_class(a.tls),
        }
        if not a.cluster:
            host, port = a.nodes[0]
            pool = valkey.ConnectionPool(host=host, port=port, db=a.db, **common)
            return valkey.Valkey(connection_pool=pool)
        from valkey.cluster import ClusterNode, ValkeyCluster

        host, port = a.nodes[0]  # given as a URL, the nodes' pools take the connection class
        nodes = [ClusterNode(host, port) for host, port in a.nodes[1:]]
        return ValkeyCluster(
            url=f"redis://{host}:{port}", startup_nodes=nodes, cluster_error_retry_attempts=1, **common
        )

    def _late_call(self) -> None:
        """A call cut at its deadline; the third in a row skips the server for a while, and so
        does each one after that until a call is on time (the pause doubling)."""
        with self._lock:
            self.deadline_misses += 1
            self._late += 1
            if self._late < SLOW_AFTER:
                return
            pause = self._slow_pause
            self._slow_until = time.monotonic() + pause
            first = pause == SLOW_PAUSE[0]
            self._slow_pause = min(SLOW_PAUSE[1], pause * 2)
        if first:
            _LOG.warning(
                "shared store %s answers slower than its deadlines: working locally, asking it again "
                "with backoff",
                self.address,
            )

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            was_down, self.down = self.down, True
            self._retry_at = time.monotonic() + self._pause
            self._pause = min(self._max_backoff, self._pause * 2)
            if self.address.cluster:
                self._client = None  # the slot map may be stale: rebuild it on the next try
            if not was_down:
                self.outages += 1
        if not was_down:
            _LOG.warning(
                "shared store %s is unreachable (%s): working locally, retrying with backoff",
                self.address,
                exc,
            )

    def _slower(self) -> bool:
        """After a timeout: raise the timeout below its ceiling (a new client takes it). ``True``
        when the server had been answering, so this is slowness, not an outage; a server that
        never answered, or is down, or a timeout at the ceiling, counts as an outage (and the
        retry after the backoff already waits longer)."""
        with self._lock:
            ceiling = max(self.address.timeout, self.address.max_timeout)
            if self.timeout >= ceiling:
                return False
            self.timeout = min(ceiling, self.timeout * 2)
            self._quick = 0
            self._client = None  # the next call connects with the new timeout
            slow = self._answered and not self.down
            self.slow_calls += int(slow)
        _LOG.info("shared store %s answered slowly: timeout raised to %g s", self.address, self.timeout)
        return slow

    def _succeeded(self, seconds: float) -> None:
        with self._lock:
            was_down, self.down = self.down, False
            self._late, self._slow_pause = 0, SLOW_PAUSE[0]
            self._pause = self._backoff
            self._answered = True
            # well within the timeout for a while: step back toward the URL's own
            self._quick = self._quick + 1 if seconds < self.timeout / 4 else 0
            if self._quick >= _QUICK_CALLS and self.timeout > self.address.timeout:
                self.timeout = max(self.address.timeout, self.timeout / 2)
                self._quick = 0
                self._client = None
        if was_down:
            _LOG.warning("shared store %s answers again: sharing resumed", self.address)
