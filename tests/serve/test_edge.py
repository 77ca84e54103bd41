"""``kamera serve`` attacked as a stranger would: each attack replayed, its outcome checked, and
``/health`` answering while it runs. Live servers on 127.0.0.1, the official openai client,
raw sockets where a client would misbehave; no timed assertions (10 s is a generous bound on a
health check, not a measurement).
"""

from __future__ import annotations

import base64
import http.client
import http.server
import io
import json
import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from PIL import Image

from kamera_agent.config import WindowConfig
from kamera_agent.serve import ImageFetching
from tests.serve.conftest import (
    MODEL,
    LiveServer,
    error_of,
    healthy,
    metric,
    post,
    rss,
    sent,
    shot,
    while_healthy,
)

SYSTEM = {"role": "system", "content": "Answer briefly."}
Serve = Callable[..., LiveServer]


def _image_message(url: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what?"}],
    }


@pytest.fixture
def media(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An allowed folder with one PNG, and things a stranger might name instead."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    Image.new("RGB", (56, 56), (10, 200, 30)).save(allowed / "ok.png")
    outside = tmp_path / "outside.png"
    Image.new("RGB", (56, 56), (200, 10, 30)).save(outside)
    (allowed / "escape.png").symlink_to(outside)
    fifo = allowed / "pipe.png"
    os.mkfifo(fifo)
    yield {
        "folder": str(allowed),
        "ok": (allowed / "ok.png").as_uri(),
        "zero": "file:///dev/zero",
        "fifo": fifo.as_uri(),
        "outside": outside.as_uri(),
        "escape": (allowed / "escape.png").as_uri(),
        "passwd": "file:///etc/passwd",
        "missing": (allowed / "missing.png").as_uri(),
        "dotdot": "file://" + str(allowed) + "/../outside.png",
    }


def test_local_files_only_under_the_allowed_folder_and_every_refusal_reads_the_same(
    serve: Serve, media: dict[str, str]
) -> None:
    live = serve(local_media=Path(media["folder"]))
    ask = live.client.chat.completions.create
    assert ask(model=MODEL, messages=[SYSTEM, _image_message(media["ok"])], temperature=0).usage  # served
    bodies = []
    for name in ("zero", "fifo", "outside", "escape", "passwd", "missing", "dotdot"):
        messages = [SYSTEM, _image_message(media[name])]
        status, body = while_healthy(live, lambda m=messages: error_of(lambda: ask(model=MODEL, messages=m)))
        assert status == 400, name
        bodies.append(body)
    assert all(body == bodies[0] for body in bodies), bodies  # no existence oracle, no path
    assert "/" not in bodies[0]["message"].split(":", 1)[1] and "Errno" not in bodies[0]["message"]
    off = serve()  # no folder allowed: the good file is refused the same way
    assert (
        error_of(
            lambda: off.client.chat.completions.create(
                model=MODEL, messages=[SYSTEM, _image_message(media["ok"])]
            )
        )[1]
        == bodies[0]
    )


def test_bodies_too_large_too_many_or_too_deep_are_refused_before_they_cost(serve: Serve) -> None:
    live = serve(max_request_bytes=1 << 20)

    def huge() -> tuple[int, Any]:  # 50 MB announced, 64 KiB sent: refused without reading the rest
        sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
        try:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 52428800\r\n\r\n" + b"[" * 65536
            )
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                piece = sock.recv(65536)
                if not piece:
                    break
                reply += piece
        finally:
            sock.close()
        text = reply.decode("latin-1")
        return int(text.split(" ", 2)[1]), text

    status, reply = while_healthy(live, huge)
    assert status == 413 and '"type":"invalid_request_error"' in reply.replace(" ", "")
    chunked = b'{"model": "' + b"x" * (2 << 20) + b'"}'  # no Content-Length: counted while read
    status, body = while_healthy(live, lambda: post(live, chunked, chunked=True))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    many = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 10_000}).encode()
    plain = serve()
    status, body = while_healthy(plain, lambda: post(plain, many))
    assert status == 400 and "over the limit" in body["error"]["message"]
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body = post(plain, deep)
    assert status == 400 and body["error"]["message"] == "the body is nested too deeply"


def test_bad_fields_are_named_400s_never_plain_500s(serve: Serve) -> None:
    live = serve()
    good = [SYSTEM, shot(0, "what?")]
    for extra, words in (
        ({"seed": 2**70}, "seed"),
        ({"stop": ["", "x"]}, "stop must be a tuple of non-empty strings"),  # refused by DecodeConfig
        ({"extra_body": {"kamera": {"device": "cuda"}}}, "kamera.device"),
        ({"extra_body": {"kamera": {"dtype": "float16"}}}, "kamera.dtype"),
        ({"extra_body": {"kamera": {"threads": 7}}}, "kamera.threads"),
    ):
        status, body = error_of(
            lambda e=extra: live.client.chat.completions.create(model=MODEL, messages=good, **e)
        )
        assert status == 400 and words in body["message"], body
        assert body["param"] == words.split(" ")[0] or "kamera" in words, body
    status, body = post(live, b"not json at all")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    with urllib.request.urlopen(live.url + "/health") as response:
        assert response.status == 200
    try:
        urllib.request.urlopen(live.url + "/no/such/route")
    except urllib.error.HTTPError as exc:
        assert exc.code == 404 and "error" in json.loads(exc.read())


def test_fetching_never_reaches_private_addresses(serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loopback server counts what it is asked; none of these URLs reaches it, a redirect from
    an address treated as public to a private one included."""
    import kamera_agent.serve.fetch as fetch

    seen: list[str] = []
    png = base64.b64decode(shot(3)["content"][0]["image_url"]["url"].split(",", 1)[1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(f"{self.server.server_address[0]}{self.path}")
            if self.path == "/hop":
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{private.server_address[1]}/x.png")
                self.end_headers()
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: Any) -> None:
            pass

    private = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    public = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Handler)
    for host in (private, public):
        threading.Thread(target=host.serve_forever, daemon=True).start()
    real = fetch.public_address
    monkeypatch.setattr(fetch, "public_address", lambda address: address == "127.0.0.2" or real(address))
    port = private.server_address[1]
    live = serve(fetching=ImageFetching(enabled=True, timeout=5))
    try:
        bodies = []
        for url in (
            f"http://127.0.0.1:{port}/x.png",
            f"http://localhost:{port}/x.png",
            f"http://2130706433:{port}/x.png",  # 127.0.0.1 as a decimal
            f"http://[::ffff:127.0.0.1]:{port}/x.png",
            f"http://127.0.0.2:{public.server_address[1]}/hop",  # allowed, redirects to loopback
            "http://127.0.0.1:1/closed.png",  # nothing listens: no port-scan oracle either
        ):
            messages = [SYSTEM, _image_message(url)]
            status, body = error_of(
                lambda m=messages: live.client.chat.completions.create(model=MODEL, messages=m)
            )
            assert status == 400, url
            bodies.append(body)
        assert all(body == bodies[0] for body in bodies)
        assert all(not hit.startswith("127.0.0.1") for hit in seen), seen  # the private server saw nothing
        assert any(hit.startswith("127.0.0.2") for hit in seen)  # the allowed hop was asked
    finally:
        for host in (private, public):
            host.shutdown()
            host.server_close()


def test_a_client_that_disconnects_mid_stream_frees_the_model(
    serve: Serve, demo_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo_backend, "_eos", set())  # no end of answer: only max_tokens or a cancel stops it
    live = serve()
    asked = [SYSTEM, shot(0, "what?")]
    sock = sent(
        live, {"model": MODEL, "messages": asked, "stream": True, "max_tokens": 3000, "temperature": 0}
    )
    received = b""
    while received.count(b"data: ") < 4:  # the stream is under way
        received += sock.recv(4096)
    sock.close()  # the client goes away
    response = live.client.chat.completions.create(
        model=MODEL, messages=[SYSTEM, shot(1, "and?")], max_tokens=2, temperature=0
    )
    assert response.usage is not None  # served next (after the cancelled one stopped)
    metrics = urllib.request.urlopen(live.url + "/metrics").read().decode()
    cancelled = float(metric(metrics, "cancelled_total"))
    after = float(metric(metrics, "tokens_after_cancel_total"))
    assert cancelled == 1 and after <= 1, (cancelled, after)
    assert float(metric(metrics, "completion_tokens_total")) < 3000  # it did not run to max_tokens


def test_large_images_are_served_within_the_cache_budgets(serve: Serve) -> None:
    images, chunks, store = 16 << 20, 16 << 20, 64 << 20
    live = serve(
        config=WindowConfig(memory_limit=store),
        image_cache_bytes=images,
        chunk_cache_bytes=chunks,
        max_sessions=2,
    )

    def big(i: int) -> str:
        buffer = io.BytesIO()
        Image.new("RGB", (3000, 3000), (i * 19 % 256, 90, 200 - i)).save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    urls = [big(i) for i in range(13)]  # made before the baseline: the client shares this process
    live.client.chat.completions.create(
        model=MODEL, messages=[SYSTEM, _image_message(urls[12])], max_tokens=1
    )
    baseline = rss()  # warmed up: the model, the server and one image processed
    for url in urls[:12]:
        response = while_healthy(
            live,
            lambda u=url: live.client.chat.completions.create(
                model=MODEL, messages=[SYSTEM, _image_message(u)], max_tokens=1
            ),
        )
        assert response.usage is not None
    growth = rss() - baseline
    assert growth <= images + chunks + store + (64 << 20), growth / 2**20
    assert live.server.images.nbytes <= images and live.server.messages.nbytes <= chunks


def test_tenants_never_share_a_window(serve: Serve, tmp_path: Path) -> None:
    live = serve(api_keys={"key-a": "tenant-a", "key-b": "tenant-b"})
    a = openai.OpenAI(base_url=live.url + "/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=live.url + "/v1", api_key="key-b", max_retries=0)
    anonymous = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0)
    history = [SYSTEM, shot(0, "first?"), {"role": "assistant", "content": "ok"}]
    first = a.chat.completions.create(model=MODEL, messages=[*history, shot(1, "second?")], temperature=0)
    session = first.model_extra["kamera"]["session_id"]
    held = live.server.sessions._sessions[("tenant-a", session)].window
    refs, stats = held.refs, held.stats.total
    grab = b.chat.completions.create(
        model=MODEL,
        messages=[*history, shot(1, "second?")],
        temperature=0,
        extra_body={"session_id": session},
    )
    assert (
        grab.usage.prompt_tokens_details.cached_tokens < grab.usage.prompt_tokens
    )  # its own window, built anew
    assert ("tenant-b", session) in live.server.sessions._sessions
    assert held.refs == refs and held.stats.total == stats  # A's window untouched
    matched = b.chat.completions.create(model=MODEL, messages=[*history, shot(1, "second?")], temperature=0)
    assert matched.model_extra["kamera"]["session_id"] != session  # content matching stays within B
    for route in ("/v1/models", "/metrics"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(live.url + route)
        assert refused.value.code == 401 and "invalid_api_key" in refused.value.read().decode()
    with pytest.raises(openai.AuthenticationError):
        anonymous.chat.completions.create(model=MODEL, messages=[SYSTEM, shot(0, "x")])
    assert healthy(live)  # the one open route


def test_the_prompt_split_adds_up_and_a_re_sent_screenshot_costs_no_more_than_its_prompt(
    serve: Serve,
) -> None:
    """The screenshot sent again at the front used to re-form everything after it on top of
    its recall (more than the whole prompt); one arrange bounded by a re-prefill from the front
    costs at most the prompt."""
    live = serve(config=WindowConfig.exact())
    base = [SYSTEM, shot(0, "first"), {"role": "assistant", "content": "ok"}]
    sent = [
        [*base, shot(1, "second?")],
        [SYSTEM, shot(1, "second?"), {"role": "assistant", "content": "ok"}, shot(2, "third?")],
        [*base, shot(1, "second?"), {"role": "assistant", "content": "ok"}, shot(3, "and?")],
    ]
    for messages in sent:
        response = live.client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
        split = response.model_extra["kamera"]["prompt"]
        assert sum(split.values()) == response.usage.prompt_tokens
        assert (
            response.usage.prompt_tokens_details.cached_tokens
            == response.usage.prompt_tokens - split["prefilled"]
        )
        kamera = response.model_extra["kamera"]
        assert kamera["tokens_prefilled"] <= response.usage.prompt_tokens
        assert kamera["beyond_prompt"] == 0


def test_a_tenant_past_its_queue_gets_429_and_others_are_served(
    serve: Serve, demo_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo_backend, "_eos", set())  # the first request runs until told to stop
    live = serve(api_keys={"key-a": "a", "key-b": "b"}, max_queued=1)
    long = {"model": MODEL, "messages": [SYSTEM, shot(0, "go")], "stream": True, "max_tokens": 3000}
    sock = sent(live, long, key="key-a")
    while b"data: " not in sock.recv(4096):  # tenant a's one place is taken
        pass
    a = openai.OpenAI(base_url=live.url + "/v1", api_key="key-a", max_retries=0)
    with pytest.raises(openai.RateLimitError) as limited:
        a.chat.completions.create(model=MODEL, messages=[SYSTEM, shot(1, "x")], max_tokens=1)
    assert limited.value.response.headers["retry-after"] == "1"
    sock.close()  # a's long request is cancelled; b was never limited by it
    b = openai.OpenAI(base_url=live.url + "/v1", api_key="key-b", max_retries=0)
    assert b.chat.completions.create(model=MODEL, messages=[SYSTEM, shot(2, "y")], max_tokens=1).usage


def test_the_key_file_names_tenants(tmp_path: Path) -> None:
    import argparse

    from kamera_agent.errors import SettingsError
    from kamera_agent.serve.command import _api_keys

    keys = tmp_path / "keys.json"
    keys.write_text('{"k1": "alice", "k2": "bob"}')
    assert _api_keys(argparse.Namespace(api_keys=str(keys), api_key="k3")) == {
        "k1": "alice",
        "k2": "bob",
        "k3": "default",
    }
    assert _api_keys(argparse.Namespace(api_keys=None, api_key=None)) is None
    keys.write_text('["not", "a", "map"]')
    with pytest.raises(SettingsError, match="expected a JSON object"):
        _api_keys(argparse.Namespace(api_keys=str(keys), api_key=None))
    with pytest.raises(SettingsError, match="no such file"):
        _api_keys(argparse.Namespace(api_keys=str(tmp_path / "missing.json"), api_key=None))


def test_a_tenant_cannot_evict_another_tenants_sessions(serve: Serve) -> None:
    live = serve(api_keys={"key-a": "a", "key-b": "b"}, max_sessions=2)
    a = openai.OpenAI(base_url=live.url + "/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=live.url + "/v1", api_key="key-b", max_retries=0)
    held = a.chat.completions.create(model=MODEL, messages=[SYSTEM, shot(0, "mine")], max_tokens=1)
    session = held.model_extra["kamera"]["session_id"]
    for i in range(5):  # b churns through more sessions than it may keep
        b.chat.completions.create(
            model=MODEL,
            messages=[SYSTEM, shot(10 + i, "x")],
            max_tokens=1,
            extra_body={"session_id": f"b{i}"},
        )
    assert ("a", session) in live.server.sessions._sessions
    assert sum(key[0] == "b" for key in live.server.sessions._sessions) == 2


def test_a_slow_sender_is_timed_out(serve: Serve) -> None:
    live = serve(read_timeout=1.0)

    def slow() -> str:
        sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
        try:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            return sock.recv(65536).decode("latin-1")  # the rest never comes
        finally:
            sock.close()

    assert " 408 " in while_healthy(live, slow).split("\r\n", 1)[0]
