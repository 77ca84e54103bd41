"""Live conversation windows, one per session, bounded, kept apart by tenant and matched to
requests by content within one.

Why match by content: agent frameworks send no session id; they resend the history. The
window that already holds most of a request's messages is the one whose edit is cheapest, so
a request goes to the session whose last request shares the longest leading run of messages
with it (ties and zero runs: the most messages in common), under the same system prompt and
settings; an explicit name (``session_id``, ``prompt_cache_key`` or ``user``) pins it.

Tenants never meet: every lookup, by content or by name, is within the request's tenant (its
API key), so another tenant's first message or session id finds nothing of this one's, and a
session id the server hands out is 128 random bits. Windows share one store, keyed by tenant
(each tenant's windows key their chunks in its namespace: `ServeSettings.cache_salt`), so a new
session reuses the KV its tenant's other windows made, and another tenant's only where the server
shares content on purpose.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kamera_agent.config import WindowConfig
from kamera_agent.serve.fidelity import Fidelity
from kamera_agent.window import KameraWindow

__all__ = ["Session", "SessionPool"]


@dataclass
class Session:
    """One conversation: its window and what its last request held."""

    id: str
    tenant: str
    window: KameraWindow
    system: str | None
    settings: str
    digests: list[str] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    pinned: bool = False
    busy: bool = False
    """A request is editing or reading its window (between decode steps it may not hold the
    model): another request matched by content goes elsewhere, one pinned to it waits."""


class SessionPool:
    """At most ``max_sessions`` windows per tenant (its least recently used leave first: a tenant
    never evicts another's), each dropped after ``idle_seconds`` unused; their engine caches
    held within a byte limit by `bound_caches`. Not thread-safe: the server calls it under its
    model lock.

    Args:
        make_window: builds a window for ``(tenant, system prompt, settings)``.
    """

    def __init__(
        self,
        make_window: Callable[[str, str | None, WindowConfig], KameraWindow],
        max_sessions: int = 16,
        idle_seconds: float = 1800.0,
    ) -> None:
        self._make = make_window
        self.max_sessions, self.idle_seconds = max_sessions, idle_seconds
        self._sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self.created = 0
        self.dropped = 0
        self.cache_bytes = 0
        """What the windows' engine caches held after the last `bound_caches`."""

    def __len__(self) -> int:
        return len(self._sessions)

    def count(self, tenant: str) -> int:
        """Live sessions of ``tenant`` (read from another thread: over a copy of the keys)."""
        return sum(1 for key in list(self._sessions) if key[0] == tenant)

    def session_for(
        self,
        tenant: str,
        pinned: str | None,
        system: str | None,
        fidelity: Fidelity,
        digests: list[str],
    ) -> Session:
        """The session of ``tenant`` a request goes to (made if none fits; a pinned one may be
        busy, and its request must wait until it is not)."""
        self._drop_idle()
        settings = fidelity.key
        if pinned is not None:
            session = self._sessions.get((tenant, pinned))
            if session is None or session.system != system or session.settings != settings:
                session = self._new(tenant, system, fidelity, pinned)
            return self._touch(session)
        best, score = None, (0, 0)
        wanted = set(digests)
        for session in self._sessions.values():
            if session.tenant != tenant or session.pinned or session.busy:
                continue
            if session.system != system or session.settings != settings:
                continue
            lead = _common_prefix(session.digests, digests)
            found = (lead, len(wanted & set(session.digests)))
            if found > score:
                best, score = session, found
        return self._touch(best if best is not None else self._new(tenant, system, fidelity, None))

    def bound_caches(self, limit: int) -> int:
        """Release the engine caches of the least recently used idle windows, every tenant's,
        until all windows' caches together hold at most ``limit`` bytes; a busy window's is in
        use and stays. A released window keeps its chunks: its next answer assembles them again
        from the store (a copy, not a forward, while the store holds them). Another tenant's load
        can thus slow a tenant's next request; it never shows it the other's content.

        Returns: how many windows released their caches. Mutates: windows' caches; ``cache_bytes``.
        """
        held = {key: session.window.cache_bytes for key, session in self._sessions.items()}
        total, released = sum(held.values()), 0
        for key, session in self._sessions.items():  # least recently used first
            if total <= limit:
                break
            if held[key] and not session.busy:
                total -= session.window.release_cache()
                released += 1
        self.cache_bytes = total
        return released

    def _new(self, tenant: str, system: str | None, fidelity: Fidelity, pinned: str | None) -> Session:
        own = [key for key in self._sessions if key[0] == tenant]  # least recently used first
        for key in own[: max(0, len(own) - self.max_sessions + 1)]:  # a tenant evicts its own only
            del self._sessions[key]
            self.dropped += 1
        session_id = pinned or f"kam-{uuid.uuid4().hex}"
        window = self._make(tenant, system, fidelity.config)
        session = Session(session_id, tenant, window, system, fidelity.key, pinned=pinned is not None)
        self._sessions[(tenant, session_id)] = session
        self.created += 1
        return session

    def _touch(self, session: Session) -> Session:
        session.last_used = time.monotonic()
        self._sessions.move_to_end((session.tenant, session.id))
        return session

    def _drop_idle(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self._sessions.items() if now - s.last_used > self.idle_seconds]:
            del self._sessions[key]
            self.dropped += 1


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
