"""Live conversation windows, one per session, bounded and matched to requests by content.

Why match by content: agent frameworks send no session id; they resend the history. The
window that already holds most of a request's messages is the one whose edit is cheapest, so
a request goes to the session whose last request shares the longest leading run of messages
with it (ties and zero runs: the most messages in common), under the same system prompt and
settings; an explicit ``session_id`` (or the ``user`` field) pins it. Windows share one store,
so even a new session reuses every canonical, vision output and patch the others made.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kamera_agent.window import KameraWindow

__all__ = ["Session", "SessionPool"]


@dataclass
class Session:
    """One conversation: its window and what its last request held."""

    id: str
    window: KameraWindow
    system: str | None
    settings: str
    digests: list[str] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    pinned: bool = False


class SessionPool:
    """At most ``max_sessions`` windows (least recently used leave first), each dropped after
    ``idle_seconds`` unused. Not thread-safe: the server calls it under its model lock.

    Args:
        make_window: builds a window for ``(system prompt, settings key)``.
    """

    def __init__(
        self,
        make_window: Callable[[str | None, str], KameraWindow],
        max_sessions: int = 16,
        idle_seconds: float = 1800.0,
    ) -> None:
        self._make = make_window
        self.max_sessions, self.idle_seconds = max_sessions, idle_seconds
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.created = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def session_for(
        self, pinned: str | None, system: str | None, settings: str, digests: list[str]
    ) -> Session:
        """The session a request goes to (made if none fits)."""
        self._drop_idle()
        if pinned is not None:
            session = self._sessions.get(pinned)
            if session is None or session.system != system or session.settings != settings:
                session = self._new(system, settings, pinned)
            return self._touch(session)
        best, score = None, (0, 0)
        wanted = set(digests)
        for session in self._sessions.values():
            if session.pinned or session.system != system or session.settings != settings:
                continue
            lead = _common_prefix(session.digests, digests)
            found = (lead, len(wanted & set(session.digests)))
            if found > score:
                best, score = session, found
        return self._touch(best if best is not None else self._new(system, settings, None))

    def _new(self, system: str | None, settings: str, pinned: str | None) -> Session:
        while len(self._sessions) >= self.max_sessions:
            self._sessions.popitem(last=False)
            self.dropped += 1
        session_id = pinned or f"kam-{uuid.uuid4().hex[:16]}"
        session = Session(
            session_id, self._make(system, settings), system, settings, pinned=pinned is not None
        )
        self._sessions[session_id] = session
        self.created += 1
        return session

    def _touch(self, session: Session) -> Session:
        session.last_used = time.monotonic()
        self._sessions.move_to_end(session.id)
        return session

    def _drop_idle(self) -> None:
        now = time.monotonic()
        for session_id in [s.id for s in self._sessions.values() if now - s.last_used > self.idle_seconds]:
            del self._sessions[session_id]
            self.dropped += 1


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
