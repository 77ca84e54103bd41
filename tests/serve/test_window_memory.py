"""Live windows' engine caches held within one byte limit, every tenant's together.

Why: each window keeps the cache its last answer was decoded over (spare capacity for appends
included), so a server's memory grew with its sessions, never bounded by bytes. Past
``window_cache_bytes`` the least recently used idle windows release theirs; a released window
assembles its chunks again from the store, so it answers the same for the same forward tokens.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from kamera_agent.config import WindowConfig
from kamera_agent.errors import SettingsError
from kamera_agent.serve import ServeSettings
from tests.serve.conftest import MODEL, LiveServer, shot

Serve = Callable[..., LiveServer]
SYSTEM = {"role": "system", "content": "Answer briefly."}


def _turns(live: LiveServer, session: str, first: int, count: int) -> list[Any]:
    """A screenshot conversation of ``count`` turns pinned to ``session``, frames from ``first``."""
    history: list[dict[str, Any]] = []
    replies = []
    for i in range(first, first + count):
        messages = [SYSTEM, *history, shot(i, "What now?")]
        reply = live.client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            extra_body={"session_id": session},  # type: ignore[arg-type]
        )
        replies.append(reply)
        history += [
            shot(i, "What now?"),
            {"role": "assistant", "content": reply.choices[0].message.content or "."},
        ]
    return replies


def _released(live: LiveServer) -> int:
    return live.server.metrics.counts["window_caches_released"]


def _forward_tokens(reply: Any) -> int:
    return int(reply.model_extra["kamera"]["tokens_prefilled"])


def test_windows_past_the_limit_release_their_caches_and_answer_the_same(serve: Serve) -> None:
    reference = serve()  # two conversations where nothing is ever released
    _turns(reference, "a", 0, 1)
    alone = reference.server.sessions.cache_bytes
    _turns(reference, "b", 10, 1)
    both = reference.server.sessions.cache_bytes
    assert 0 < alone < both and _released(reference) == 0

    limit = both - 1  # b's cache fits, a's and b's together do not
    bounded = serve(window_cache_bytes=limit)
    _turns(bounded, "a", 0, 1)
    _turns(bounded, "b", 10, 1)  # b's answer puts the server over: a, the older, releases
    pool = bounded.server.sessions
    assert _released(bounded) == 1 and pool.cache_bytes == both - alone
    windows = {key[1]: session.window for key, session in pool._sessions.items()}
    assert windows["a"].cache_bytes == 0 and windows["b"].cache_bytes == both - alone

    again, expected = _turns(bounded, "a", 0, 3), _turns(reference, "a", 0, 3)
    for turn, (mine, theirs) in enumerate(zip(again, expected, strict=True)):
        assert mine.choices[0].message.content == theirs.choices[0].message.content, turn
        assert _forward_tokens(mine) == _forward_tokens(theirs), turn  # placed from the store
    assert _released(bounded) >= 2 and pool.cache_bytes <= limit  # b, now the older, released too


def test_a_limit_of_nothing_keeps_no_cache_and_the_metrics_show_it(serve: Serve) -> None:
    live = serve(window_cache_bytes=0)
    replies = _turns(live, "a", 0, 2)
    assert all(reply.choices[0].message.content is not None for reply in replies)
    pool = live.server.sessions
    assert pool.cache_bytes == 0 and _released(live) == 2
    with urllib.request.urlopen(live.url + "/metrics", timeout=5) as response:
        body = response.read().decode()
    assert "kamera_window_cache_bytes 0" in body and "kamera_window_caches_released_total 2" in body


def test_a_negative_limit_is_refused_by_name() -> None:
    with pytest.raises(SettingsError, match="window_cache_bytes -1"):
        ServeSettings(MODEL, WindowConfig(), window_cache_bytes=-1)
