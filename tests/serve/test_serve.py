"""``kamera serve`` over HTTP with the official ``openai`` client: reuse, fidelity, errors, load.

Every figure a test asserts comes from the server's own usage and op reports; fidelity is
checked against a fresh server given the same messages (which prefills everything).
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from PIL import Image

from kamera_agent.config import WindowConfig
from tests.serve.conftest import MODEL, LiveServer, shot

SYSTEM = {"role": "system", "content": "Answer briefly."}
Serve = Callable[..., LiveServer]


def _ask(
    live: LiveServer, messages: list[dict[str, Any]], session_id: str | None = None, **extra: Any
) -> Any:
    """One greedy request; ``session_id`` rides in the body, as the client's ``extra_body``."""
    if session_id is not None:
        extra["extra_body"] = {**extra.get("extra_body", {}), "session_id": session_id}
    response = live.client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **extra)  # type: ignore[arg-type]
    if not extra.get("stream"):  # every served request's prompt split adds up (tests/serve/test_edge.py)
        split = response.model_extra["kamera"]["prompt"]
        assert sum(split.values()) == response.usage.prompt_tokens, split
        assert (
            response.usage.prompt_tokens_details.cached_tokens
            == response.usage.prompt_tokens - split["prefilled"]
        )
    return response


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def _ops(response: Any) -> list[dict[str, Any]]:
    return list(response.model_extra["kamera"]["ops"])


def _prefilled(response: Any) -> int:
    usage = response.usage
    return int(usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens)


def _run(
    live: LiveServer, count: int, keep: int = 2, stream: bool = False
) -> list[tuple[Any, list[dict[str, Any]]]]:
    """The sliding conversation; returns each turn's response and the messages it sent."""
    history: list[dict[str, Any]] = []
    out = []
    for i in range(count):
        messages = [SYSTEM, *history, shot(i, "What now?")]
        response = _streamed(live, messages) if stream else _ask(live, messages)
        out.append((response, messages))
        history += [shot(i, "What now?"), {"role": "assistant", "content": _text(response) or "."}]
        if len(history) > 2 * keep:
            del history[:2]
    return out


def _text(response: Any) -> str:
    return response.choices[0].message.content if hasattr(response, "choices") else response["text"]


def _streamed(live: LiveServer, messages: list[dict[str, Any]]) -> dict[str, Any]:
    events = _ask(live, messages, stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for event in events:
        if event.choices:
            text += event.choices[0].delta.content or ""
        if event.usage is not None:
            usage = event.usage
    return {"text": text, "usage": usage}


def test_a_sliding_screenshot_conversation_reuses_what_it_sent_before(serve: Serve) -> None:
    live = serve()
    turns = _run(live, 6)
    for turn, (response, messages) in enumerate(turns):
        cold = serve()  # a new server: its store is empty, everything is prefilled
        fresh = _ask(cold, messages)
        cold.stop()
        if turn == 0:
            continue
        usage = response.usage
        assert usage.prompt_tokens_details.cached_tokens > 0, turn
        assert usage.prompt_tokens == fresh.usage.prompt_tokens
        assert _prefilled(response) < _prefilled(fresh), (turn, _prefilled(response), _prefilled(fresh))
    edits = {kind for response, _ in turns[3:] for op in _ops(response) for kind in op["edits"]}
    assert "evict" in edits  # the dropped exchange left the window

    streamed = _run(serve(), 6, stream=True)
    for (plain, _), (flowing, _) in zip(turns, streamed, strict=True):
        assert _text(flowing) == _text(plain)
        assert flowing["usage"].prompt_tokens == plain.usage.prompt_tokens


def test_exact_settings_answer_every_turn_as_a_fresh_server_does(serve: Serve) -> None:
    live = serve(config=WindowConfig.exact())
    for turn, (response, messages) in enumerate(_run(live, 6)):
        fresh = serve(config=WindowConfig.exact())
        cold = _ask(fresh, messages)
        fresh.stop()
        assert _text(response) == _text(cold), turn
        assert cold.usage.prompt_tokens_details.cached_tokens == 0


def test_a_resent_screenshot_is_recalled_without_a_vision_forward(serve: Serve) -> None:
    live = serve()
    base = [SYSTEM, shot(0, "first"), {"role": "assistant", "content": "ok"}]
    _ask(live, [*base, shot(1, "second?")])
    _ask(
        live, [SYSTEM, shot(1, "second?"), {"role": "assistant", "content": "ok"}, shot(2, "third?")]
    )  # 0 dropped
    again = _ask(live, [*base, shot(1, "second?"), {"role": "assistant", "content": "ok"}, shot(3, "and?")])
    ops = _ops(again)
    assert [op["op"] for op in ops] == ["arrange", "ask"]
    assert ops[0]["edits"].get("recall", 0) >= 1  # the screenshot (and its text) came back
    assert sum(op["vision_encodes"] for op in ops) == 1  # only the new screenshot 3


def test_reordering_two_screenshots_runs_no_canonical_prefill(serve: Serve) -> None:
    """Both move after the task's text: each is re-conditioned (a forward), none re-encoded.
    (A screenshot moved to the very front would need its canonical: nothing precedes it.)"""
    live = serve()
    task = {"role": "user", "content": "Compare the two screenshots."}
    a, b = shot(0, "left"), shot(1, "right")
    reply = {"role": "assistant", "content": "ok"}
    _ask(live, [SYSTEM, task, reply, a, reply, b, reply, shot(2, "which?")])
    swapped = _ask(live, [SYSTEM, task, reply, b, reply, a, reply, shot(2, "which?")])
    ops = _ops(swapped)
    assert [op["op"] for op in ops] == ["arrange", "ask"]
    assert "admit" not in ops[0]["edits"] and "recall" not in ops[0]["edits"]
    assert sum(op["canonicals_formed"] for op in ops) == 0
    assert sum(op["vision_encodes"] for op in ops) == 0


def _trials() -> dict[str, list[list[dict[str, Any]]]]:
    """Request sequences of one session each, where a window op could cost more than a prefix cache."""
    reply = {"role": "assistant", "content": "ok"}
    task = {"role": "user", "content": "Compare the two screenshots."}
    a, b = shot(0, "left"), shot(1, "right")
    return {
        "re-sent screenshot": [
            [SYSTEM, shot(0, "first"), reply, shot(1, "second?")],
            [SYSTEM, shot(1, "second?"), reply, shot(2, "third?")],  # 0 dropped
            [SYSTEM, shot(0, "first"), reply, shot(1, "second?"), reply, shot(3, "and?")],  # 0 again, first
        ],
        "two swaps": [
            [SYSTEM, task, reply, a, reply, b, reply, shot(2, "which?")],
            [SYSTEM, task, reply, b, reply, a, reply, shot(2, "which?")],
            [SYSTEM, task, reply, a, reply, b, reply, shot(2, "which?")],
        ],
        "recall, then reorder": [
            [SYSTEM, a, reply, b, reply, shot(2, "now?")],
            [SYSTEM, b, reply, shot(2, "now?"), reply, shot(3, "and?")],  # a dropped
            [SYSTEM, b, reply, a, reply, shot(2, "now?"), reply, shot(4, "again?")],  # a back, mid-history
        ],
    }


@pytest.mark.parametrize("preset", ["exact", "defaults"])
def test_no_request_prefills_more_than_a_cold_server(serve: Serve, preset: str) -> None:
    """Per request, the window's forwards prefill at most what a fresh server prefills for the
    same messages (its whole prompt): one arrange per request, bounded by a re-prefill from its
    first changed slot. The drift budget's audits are counted apart (the estimator's cost: a
    sample of the rows it approximated, never more than those)."""
    config = WindowConfig.exact() if preset == "exact" else WindowConfig()
    for name, requests in _trials().items():
        live = serve(config=config)
        for turn, messages in enumerate(requests):
            warm = _ask(live, messages)
            cold_server = serve(config=config)
            cold = _ask(cold_server, messages)
            cold_server.stop()
            spent, fresh = (r.model_extra["kamera"]["tokens_prefilled"] for r in (warm, cold))
            assert fresh == cold.usage.prompt_tokens  # a cold server prefills its whole prompt
            audits = sum(int(op.get("audit_tokens", 0)) for op in _ops(warm))
            assert audits == 0 or preset == "defaults"
            assert spent - audits <= fresh, (name, turn, spent, fresh, _ops(warm))
            if preset == "exact":
                assert _text(warm) == _text(cold), (name, turn)


def test_bad_requests_get_4xx_and_the_server_keeps_serving(serve: Serve) -> None:
    live = serve()
    good = [SYSTEM, shot(0, "What now?")]
    broken = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
    }
    audio = {
        "role": "user",
        "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
    }
    remote = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "https://127.0.0.1:9/x.png"}}],
    }
    long_text = {"role": "user", "content": "lorem ipsum " * 4000}
    buffer = io.BytesIO()
    Image.new("RGB", (9000, 9000)).save(buffer, format="PNG")  # 81 Mpixel, over the 50 Mpixel limit
    huge = {
        "role": "user",
        "content": [
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()},
            }
        ],
    }
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"messages": [SYSTEM, broken]}, openai.BadRequestError, "base64"),
        ({"messages": [SYSTEM, audio]}, openai.BadRequestError, "input_audio"),
        ({"messages": [SYSTEM, remote]}, openai.BadRequestError, "fetching image URLs is off"),
        ({"messages": [SYSTEM, long_text]}, openai.BadRequestError, "the model has 4096"),
        ({"messages": [SYSTEM, huge]}, openai.BadRequestError, "resize it"),
        ({"messages": good, "model": "gpt-9"}, openai.NotFoundError, "not served here"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, openai.BadRequestError, "last message"),
        ({"messages": good, "n": 2, "stream": True}, openai.BadRequestError, "n > 1"),
    ]
    for request, error, words in cases:
        arguments = {"model": MODEL, "temperature": 0, **request}
        with pytest.raises(error, match=re.escape(words)):
            live.client.chat.completions.create(**arguments)  # type: ignore[call-overload]
        assert _text(_ask(live, good)) is not None  # the next good request succeeds
    with pytest.raises(openai.BadRequestError, match="base64"):  # refused before streaming starts
        for _ in _ask(live, [SYSTEM, broken], stream=True):
            pass
    body = _get(live.url + "/metrics")
    assert 'kamera_requests_total{status="400"} 8' in body and 'kamera_requests_total{status="404"} 1' in body


def test_concurrent_clients_all_succeed_and_metrics_add_up(serve: Serve) -> None:
    live = serve()

    def client(k: int) -> list[Any]:
        history: list[dict[str, Any]] = [SYSTEM]
        responses = []
        for i in range(20):
            messages = [*history, shot(100 * k + i, f"client {k} step {i}?")]
            response = _ask(live, messages, session_id=f"client-{k}", max_tokens=2)
            responses.append(response)
            history = [SYSTEM, *messages[-1:], {"role": "assistant", "content": _text(response) or "."}]
        return responses

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = [r for rs in pool.map(client, range(4)) for r in rs]
    assert len(results) == 80
    body = _get(live.url + "/metrics")

    def metric(name: str) -> float:
        match = re.search(rf"^kamera_{name} (\S+)$", body, re.M)
        assert match, name
        return float(match.group(1))

    assert metric("prompt_tokens_total") == sum(r.usage.prompt_tokens for r in results)
    assert metric("cached_tokens_total") == sum(r.usage.prompt_tokens_details.cached_tokens for r in results)
    assert metric("completion_tokens_total") == sum(r.usage.completion_tokens for r in results)
    assert metric("sessions") == 4 and 'kamera_requests_total{status="200"} 80' in body
    ops = [op for r in results for op in _ops(r)]
    assert metric("forwards_total") == sum(op["forwards"] for op in ops)
    assert metric("tokens_prefilled_total") == sum(op["tokens_prefilled"] for op in ops)


def test_a_store_tier_reaches_the_servers_metrics_by_its_name(serve: Serve, tmp_path: Path) -> None:
    """The server's ``/metrics`` shows each tier of its store by name, with no code of its own
    per tier: here the disk tier the config names (a registered tier shows the same way)."""
    live = serve(config=WindowConfig(disk_dir=tmp_path, disk_limit=1 << 26))
    assert _text(_ask(live, [SYSTEM, shot(0, "What now?")])) is not None
    body = _get(live.url + "/metrics")
    asked = re.search(r'^kamera_store_tier_lookups_total\{tier="disk"\} (\S+)$', body, re.M)
    assert asked and float(asked.group(1)) > 0, body  # the request's chunks were looked up there
    assert "# TYPE kamera_store_tier_get_seconds_total counter" in body


def test_models_health_and_per_request_settings(serve: Serve) -> None:
    live = serve()
    assert [m.id for m in live.client.models.list()] == [MODEL]
    assert '"status":"ok"' in _get(live.url + "/health")
    exact = _ask(live, [SYSTEM, shot(0, "What now?")], extra_body={"kamera": {"preset": "exact"}})
    plain = _ask(live, [SYSTEM, shot(0, "What now?")])
    assert exact.model_extra["kamera"]["session_id"] != plain.model_extra["kamera"]["session_id"]
    for field, value in (
        ("store_url", "redis://x"),
        ("threads", 7),
        ("device", "cuda"),
        ("dtype", "float16"),
    ):
        with pytest.raises(openai.BadRequestError, match=f"kamera.{field} is not a per-request setting"):
            _ask(live, [SYSTEM, shot(0, "x")], extra_body={"kamera": {field: value}})
    with pytest.raises(openai.BadRequestError, match="rank"):
        _ask(live, [SYSTEM, shot(0, "x")], extra_body={"kamera": {"rank": -3}})


def test_the_serve_command_starts_a_server(tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "window.json"
    config.write_text('{"rank": "full"}')
    env = {**os.environ, "KAMERA_NUM_THREADS": "1"}
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "kamera_agent", "serve", "--port", str(port), "--config", str(config)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                started = process.poll() is None and time.monotonic() < deadline
                assert started, (tmp_path / "serve.log").read_text()
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        response = client.chat.completions.create(
            model=MODEL,
            messages=[SYSTEM, shot(0, "What now?")],
            temperature=0,
            max_tokens=2,  # type: ignore[list-item]
        )
        assert response.usage is not None and response.usage.prompt_tokens > 0
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=20)
        log.close()


def test_image_urls_are_fetched_only_when_enabled_and_within_limits(serve: Serve) -> None:
    """A loopback HTTP server holds a screenshot; fetching is a flag, with a size limit (and,
    for a private address such as loopback, a flag of its own: tests/serve/test_edge.py)."""
    import http.server

    from kamera_agent.serve import ImageFetching
    from tests.serve.conftest import frame_url

    png = base64.b64decode(frame_url(7).split(",", 1)[1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: Any) -> None:
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{host.server_address[1]}/shot.png"
    message = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}],
    }
    try:
        # the loopback host stands for a trusted network: fetching from it is allowed explicitly
        fetching = serve(
            fetching=ImageFetching(enabled=True, timeout=5, max_bytes=1 << 20, allow_private=True)
        )
        fetched = _ask(fetching, [SYSTEM, message])
        inline = _ask(fetching, [SYSTEM, shot(7, "?")])  # the same pixels as a data: URL: the same chunk
        assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
        assert sum(op["vision_encodes"] for op in _ops(inline)) == 0
        tiny = serve(fetching=ImageFetching(enabled=True, timeout=5, max_bytes=100, allow_private=True))
        with pytest.raises(openai.BadRequestError, match="larger than 100 bytes"):
            _ask(tiny, [SYSTEM, message])
    finally:
        host.shutdown()
        host.server_close()


def test_the_prefix_cache_mode_keeps_only_an_unchanged_prefix_and_answers_exactly(serve: Serve) -> None:
    """``reuse="prefix"``: the baseline the replay benchmark runs beside kamera. Every token is
    either an unchanged leading token or prefilled (nothing relocated, patched or kept), answers
    equal the exact kamera server's (which, on this sliding conversation, prefills as much), and
    kamera's policies unbounded (no drift budget) prefill fewer tokens."""
    unbounded = WindowConfig(drift_budget=None)
    prefix, exact, defaults = (
        serve(reuse="prefix"),
        serve(config=WindowConfig.exact()),
        serve(config=unbounded),
    )
    spent = {"prefix": 0, "exact": 0, "defaults": 0}
    turns = zip(_run(prefix, 7), _run(exact, 7), _run(defaults, 7), strict=True)
    for turn, ((cached, _), (ours, _), (cheap, _)) in enumerate(turns):
        split = cached.model_extra["kamera"]["prompt"]
        assert split["relocated"] == split["patched"] == split["kept"] == 0, (turn, split)
        assert split["prefix"] + split["prefilled"] == cached.usage.prompt_tokens
        assert _text(cached) == _text(ours), turn
        assert _prefilled(cached) >= _prefilled(ours), turn
        spent["prefix"] += _prefilled(cached)
        spent["exact"] += _prefilled(ours)
        spent["defaults"] += _prefilled(cheap)
        assert turn == 0 or split["prefix"] > 0
    assert spent["defaults"] < spent["exact"] <= spent["prefix"], spent
    with pytest.raises(openai.BadRequestError, match=r"kamera\.rank"):
        _ask(prefix, [SYSTEM, shot(0, "What now?")], extra_body={"kamera": {"rank": 4}})


def test_dropping_a_screenshot_from_an_old_message_evicts_that_chunk_alone(serve: Serve) -> None:
    """Agents drop old screenshots and keep their text (Anthropic's computer-use demo, Agent-S3):
    each message's markers are chunks of their own, so the message's text chunk is unchanged
    and the request is one evict; everything after it is reused (relocated or kept), where a
    prefix cache re-prefills from that message on. The exact preset still answers as a
    re-prefill does. (Policies unbounded: at the drift budget, see the drift test.)"""
    history = [SYSTEM]
    for i in range(4):
        history += [
            {"role": "user", "content": [*shot(i)["content"], {"type": "text", "text": f"step {i}"}]},
            {"role": "assistant", "content": "ok"},
        ]
    question = shot(9, "What now?")
    dropped = [dict(m) for m in history]
    dropped[1] = {"role": "user", "content": [{"type": "text", "text": "step 0"}]}  # its screenshot gone
    unbounded = WindowConfig(drift_budget=None)
    prefix, defaults, exact = (
        serve(reuse="prefix"),
        serve(config=unbounded),
        serve(config=WindowConfig.exact()),
    )
    for live in (prefix, defaults, exact):
        _ask(live, [*history, question], session_id="agent")
    spent = {}
    for name, live in (("prefix", prefix), ("defaults", defaults), ("exact", exact)):
        response = _ask(live, [*dropped, question], session_id="agent")
        spent[name] = _prefilled(response)
        (op,) = [op for op in _ops(response) if op["op"] == "arrange"]
        if name != "prefix":  # kamera: the screenshot's chunk leaves, nothing else does
            assert op["edits"].get("evict") == 1, op
        if name == "exact":
            assert _text(response) == _text(_ask(prefix, [*dropped, question], session_id="agent"))
    assert spent["defaults"] < spent["prefix"] / 3, spent


def test_each_response_reports_the_drift_its_answer_read(serve: Serve) -> None:
    """The defaults keep the demo model's calibrated budget: every answer's chunks are estimated
    within it, and the response says so; unbounded policies say their drift is not estimated."""
    budgeted, unbounded = serve(), serve(config=WindowConfig(drift_budget=None))
    for (response, _), (loose, _) in zip(_run(budgeted, 5), _run(unbounded, 5), strict=True):
        drift = response.model_extra["kamera"]["drift"]
        assert drift["budget"] is not None and drift["budget"] > 0
        assert drift["largest"] is not None and drift["largest"] <= drift["budget"]
        assert loose.model_extra["kamera"]["drift"]["budget"] is None
    asked = _ask(budgeted, [SYSTEM, shot(0, "What now?")], extra_body={"kamera": {"drift_budget": 0.1}})
    assert asked.model_extra["kamera"]["drift"]["budget"] == 0.1  # a session's own budget
