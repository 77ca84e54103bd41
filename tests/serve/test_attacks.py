"""No single request can kill or hold ``kamera serve``: each attack of an adversary's trial
replayed on live servers (127.0.0.1, the official openai client, raw sockets where a client
would misbehave), its outcome checked. Memory is read from /proc; the only timed assertion is
a generous bound on ``/health``. Budgets and deadlines are set small where the property is the
same (a 1.5 s header deadline, one image's worth of pixel budget); the named attacks themselves
(a 30 MB message, 49-megapixel PNGs) are sent as they were, being cheap to send.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.config import WindowConfig
from kamera_agent.errors import ConfigError, SettingsError
from kamera_agent.serve import ImageFetching, KameraServer, ServeSettings
from kamera_agent.serve.pixels import BYTES_PER_PIXEL
from tests.serve.conftest import MODEL, LiveServer, error_of, healthy, post, rss, sent, shot

SYSTEM = {"role": "system", "content": "Answer briefly."}
Serve = Callable[..., LiveServer]
MIB = 1 << 20


def _ask(live: LiveServer, messages: list[dict[str, Any]], **fields: Any) -> Any:
    return live.client.chat.completions.create(model=MODEL, messages=messages, **fields)  # type: ignore[call-overload]


def test_unseeded_samples_differ_and_seeded_ones_repeat(serve: Serve) -> None:
    live = serve()
    asked = [SYSTEM, shot(0, "say something")]
    samples = [_ask(live, asked, temperature=1.0, max_tokens=8).choices[0].message.content for _ in range(20)]
    assert len(set(samples)) > 1, samples  # the same answer 20 times was the defect
    choices = _ask(live, asked, temperature=1.0, max_tokens=8, n=8).choices
    assert len({choice.message.content for choice in choices}) > 1
    seeded = [_ask(live, asked, temperature=1.0, max_tokens=8, seed=11, logprobs=True) for _ in range(2)]
    tokens = [[step.token for step in reply.choices[0].logprobs.content] for reply in seeded]
    assert tokens[0] == tokens[1] and tokens[0]


@contextmanager
def _tokenized_lengths() -> Iterator[list[int]]:
    """The length of every text handed to a tokenizer meanwhile (the real one, watched)."""
    seen: list[int] = []
    real = ChunkEncoder.tokens

    def watched(self: ChunkEncoder, text: str) -> Any:
        seen.append(len(text))
        return real(self, text)

    ChunkEncoder.tokens = watched  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        ChunkEncoder.tokens = real  # type: ignore[method-assign]


def test_a_30_mb_message_is_refused_before_it_is_tokenized(serve: Serve) -> None:
    live = serve()
    huge = "grow " * (6 << 20)  # 30 MiB: under the 32 MiB body limit
    as_history = [
        SYSTEM,
        {"role": "user", "content": huge},
        {"role": "assistant", "content": "ok"},
        shot(0, "and?"),
    ]
    as_question = [SYSTEM, {"role": "user", "content": huge}]
    _ask(live, [SYSTEM, shot(0, "warm up")], max_tokens=1)
    baseline = rss()
    for messages in (as_history, as_question):
        with _tokenized_lengths() as lengths:
            status, body = error_of(lambda m=messages: _ask(live, m, max_tokens=1))
        assert status == 400 and body["code"] == "context_length_exceeded", body
        assert body["param"] == "messages" and "messages[1].content" in body["message"]
        assert max(lengths, default=0) < 1 << 20  # the tokenizer never saw it
    assert rss() - baseline <= 64 * MIB, (rss() - baseline) / MIB
    assert healthy(live)


def _png(width: int, height: int) -> Callable[[int], str]:
    """Data URLs of a ``width × height`` black RGB PNG, each made distinct by a text chunk: a few
    hundred KB that decode to width × height × 4 bytes."""
    row = b"\x00" * (1 + 3 * width)
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    head = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    tail = chunk(b"IDAT", idat) + chunk(b"IEND", b"")

    def url(tag: int) -> str:
        data = head + chunk(b"tEXt", b"n\x00" + str(tag).encode()) + tail
        return "data:image/png;base64," + base64.b64encode(data).decode()

    return url


def _image_message(url: str, text: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
    }


@contextmanager
def _peak_rss() -> Iterator[dict[str, int]]:
    """The process's peak resident bytes over the block (the kernel's high-water mark, reset at
    its start), in ``["peak"]``."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    out: dict[str, int] = {}
    yield out
    status = Path("/proc/self/status").read_text()
    out["peak"] = next(
        int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")
    )


def test_24_concurrent_49_megapixel_pngs_are_served_or_429_within_the_pixel_budget(serve: Serve) -> None:
    side = 7000  # 49 megapixels
    budget = side * side * BYTES_PER_PIXEL  # one such image decoding at a time
    live = serve(image_bytes_in_flight=budget, tenant_image_bytes_in_flight=budget, max_queued=32)
    url = _png(side, side)
    assert len(url(0)) < 300_000
    assert _ask(live, [SYSTEM, _image_message(url(0), "warm up")], max_tokens=1).usage  # served
    attack = [[SYSTEM, _image_message(url(i), f"what is {i}?")] for i in range(1, 25)]

    def one(messages: list[dict[str, Any]]) -> int:
        try:
            _ask(live, messages, max_tokens=1)
        except openai.RateLimitError as exc:
            assert exc.response.headers["retry-after"] == "1"
            return 429
        return 200

    rss()
    with _peak_rss() as peak, concurrent.futures.ThreadPoolExecutor(24) as pool:
        start = rss()
        statuses = list(pool.map(one, attack))
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses, statuses
    assert peak["peak"] - start <= budget + 512 * MIB, (peak["peak"] - start) / MIB
    assert live.server.pixels.held == 0 and healthy(live)


def test_refused_prompts_leave_no_memory_behind(serve: Serve) -> None:
    live = serve()

    def anyof(levels: int) -> dict[str, Any]:  # 12 levels of 3 branches: 3^12 paths in 2 KB
        defs = {
            f"l{i}": {
                "anyOf": [
                    {"$ref": f"#/$defs/l{i + 1}"},
                    {"type": "array", "items": {"$ref": f"#/$defs/l{i + 1}"}},
                    {"type": "object", "additionalProperties": {"$ref": f"#/$defs/l{i + 1}"}},
                ]
            }
            for i in range(levels)
        }
        return {
            "allOf": [{"$ref": f"#/$defs/l{i}"} for i in range(levels)],
            "$defs": {**defs, f"l{levels}": {"type": "integer"}},
        }

    def attacks(seed: int) -> list[dict[str, Any]]:
        system = [{**SYSTEM, "content": f"{seed}-{i} " + "rule " * 200_000} for i in range(4)]  # 1 MB each
        tool = {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "description": "x" * 400_000}},
        }
        tools = [
            [{**tool, "function": {**tool["function"], "name": f"f{seed}{i}"}}] * 4 for i in range(3)
        ]  # 1.6 MB each
        near = [
            {**SYSTEM, "content": f"{seed}-{i} " + "o" * 60_000} for i in range(4)
        ]  # fits by length, not in tokens
        schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": anyof(12)}}
        asked = shot(0, "go")
        return [
            *({"messages": [each, asked]} for each in system + near),
            *({"messages": [SYSTEM, asked], "tools": each} for each in tools),
            {"messages": [SYSTEM, asked], "response_format": schema},
        ]

    for warm in attacks(0):  # each kind once: the allocator's and the code's own first costs
        assert error_of(lambda w=warm: _ask(live, max_tokens=1, **w))[0] == 400
    baseline = rss()
    for seed in (1, 2):
        for each in attacks(seed):
            status, body = error_of(lambda e=each: _ask(live, max_tokens=1, **e))
            assert status == 400, body
    growth = rss() - baseline
    assert growth <= 64 * MIB, growth / MIB
    assert live.server.messages.anchor_nbytes <= live.server.settings.anchor_cache_bytes


def test_a_long_request_gives_the_model_up_between_decode_steps(
    serve: Serve, demo_backend: TransformersBackend
) -> None:
    live = serve()
    banned = {str(token): -100 for token in demo_backend._eos}  # no end of answer: 8 × 500 tokens
    hostile = {"model": MODEL, "messages": [SYSTEM, shot(0, "go on")], "n": 8, "max_tokens": 500}
    sock = sent(live, {**hostile, "logit_bias": banned})
    began = time.monotonic()
    try:
        while live.server.turns.steps < 20:  # the hostile request is decoding
            time.sleep(0.01)
        time.sleep(max(0.0, began + 1.0 - time.monotonic()))  # sent 1 s later, as in the trial
        short = _ask(live, [SYSTEM, shot(1, "quick")], max_tokens=1)
        waited = short.model_extra["kamera"]["waited_decode_steps"]  # counted by the server
        assert waited <= 8, waited
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(1)  # the hostile request is still going: the short one did not wait it out
    finally:
        sock.close()  # the hostile request is cancelled


def test_a_request_over_the_decode_budget_is_refused_at_admission(serve: Serve) -> None:
    live = serve(max_decode_tokens=1000)
    status, body = error_of(lambda: _ask(live, [SYSTEM, shot(0, "go")], n=8, max_tokens=500))
    assert status == 400 and body["param"] == "max_tokens" and "4,000" in body["message"]


def test_slow_headers_are_closed_at_their_deadline_and_health_answers(serve: Serve) -> None:
    live = serve(header_timeout=1.5)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # as the trial's ulimit -n 1024
    try:
        peer = [sys.executable, str(Path(__file__).with_name("slow_peer.py")), str(live.port), "1100", "20"]
        done = subprocess.run(peer, capture_output=True, text=True, timeout=90)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["closed"] == report["opened"] == 1100, report  # every one closed by the server
    assert report["health"] == 200, report
    assert healthy(live)


def test_past_the_concurrency_limit_requests_get_503_and_health_still_answers(
    serve: Serve, demo_backend: TransformersBackend
) -> None:
    live = serve(max_concurrent=1)
    banned = {str(token): -100 for token in demo_backend._eos}
    long = {"model": MODEL, "messages": [SYSTEM, shot(0, "go")], "stream": True, "max_tokens": 3000}
    sock = sent(live, {**long, "logit_bias": banned})
    try:
        while b"data: " not in sock.recv(4096):  # the one place is taken
            pass
        status, body = error_of(lambda: _ask(live, [SYSTEM, shot(1, "x")], max_tokens=1))
        assert status == 503 and body["code"] == "server_busy"
        assert healthy(live)
    finally:
        sock.close()


def test_a_drip_fed_image_fetch_fails_at_its_deadline(serve: Serve) -> None:
    sent: list[int] = []
    server = socket.create_server(("127.0.0.1", 0))

    def drip() -> None:  # a 100,000-byte image, one byte every 50 ms: 83 minutes if allowed
        connection, _ = server.accept()
        connection.recv(65536)
        count = 0
        try:
            connection.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 100000\r\n\r\n"
            )
            for _ in range(100_000):
                connection.sendall(b"\x89")
                count += 1
                time.sleep(0.05)
        except OSError:
            pass  # the fetcher hung up
        finally:
            sent.append(count)
            connection.close()

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    live = serve(fetching=ImageFetching(enabled=True, timeout=1.0, allow_private=True))
    url = f"http://127.0.0.1:{server.getsockname()[1]}/slow.png"
    try:
        status, body = error_of(lambda: _ask(live, [SYSTEM, _image_message(url, "what?")], max_tokens=1))
        dripper.join(timeout=30)
    finally:
        server.close()
    assert status == 400 and body["code"] == "image_url_refused"
    assert sent and sent[0] < 1000, sent  # cut off at the deadline, not read to its end


def test_seventy_distinct_settings_racing_a_waiting_request_get_no_5xx(
    serve: Serve, demo_backend: TransformersBackend
) -> None:
    """A request with its own settings waits behind a long answer while 70 others with settings
    of their own arrive: a table of recent settings used to drop the waiting one's (a 500)."""
    live = serve(max_queued=100)
    banned = {str(token): -100 for token in demo_backend._eos}
    long = {"model": MODEL, "messages": [SYSTEM, shot(9, "go")], "stream": True, "max_tokens": 3000}
    sock = sent(live, {**long, "logit_bias": banned})

    def one(kamera: dict[str, Any]) -> int:
        try:
            _ask(live, [SYSTEM, shot(0, "hi")], max_tokens=1, extra_body={"kamera": kamera})
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    try:
        while b"data: " not in sock.recv(4096):  # the long answer holds its turns
            pass
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            waiting = pool.submit(one, {"drift_budget": 0.123})
            statuses = list(pool.map(one, [{"drift_budget": 0.001 * (i + 1)} for i in range(70)]))
            statuses.insert(0, waiting.result())
    finally:
        sock.close()
    assert all(status < 500 for status in statuses), statuses
    assert statuses[0] == 200


def _raw(live: LiveServer, **fields: Any) -> tuple[int, dict[str, Any]]:
    """A request sent as JSON with escapes (a lone surrogate travels as ``\\ud800``)."""
    status, body = post(live, json.dumps({"model": MODEL, "max_tokens": 1, **fields}).encode())
    return status, body["error"] if status >= 400 else body


def test_each_wrong_input_is_a_4xx_naming_its_field(serve: Serve, demo_backend: TransformersBackend) -> None:
    live = serve()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}
    tools = [{"type": "function", "function": {"name": "f\ud800", "parameters": {"type": "object"}}}]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,\ud800"}}
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {
                "messages": [
                    SYSTEM,
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    shot(0, "x"),
                ]
            },
            "messages",
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"messages": [SYSTEM, shot(0, "x")], "logit_bias": {"²": 1}}, "logit_bias", "logit_bias"),
        ({"messages": [SYSTEM, {"role": "user", "content": "why\ud800"}]}, "messages", "messages[1].content"),
        (
            {"messages": [{"role": "system", "content": "\ud800"}, shot(0, "x")]},
            "messages",
            "messages[0].content",
        ),
        ({"messages": [SYSTEM, shot(0, "x")], "tools": tools}, "tools", "tools[0].function.name"),
        ({"messages": [SYSTEM, {"role": "user", "content": [image]}]}, "messages", "messages[1].content[0]"),
    ]
    for fields, param, named in cases:
        status, error = _raw(live, **fields)
        assert 400 <= status < 500 and error["param"] == param and named in error["message"], (fields, error)
    blind = LiveServer(
        KameraServer(
            TransformersBackend(demo_backend.model, tokenizer=demo_backend.tokenizer),
            ServeSettings(MODEL, WindowConfig(), max_tokens=1),
        )
    )
    try:
        status, error = _raw(blind, messages=[SYSTEM, shot(0, "what is it?")])
        assert (
            status == 400 and "messages[1].content[0]" in error["message"] and "text only" in error["message"]
        )
    finally:
        blind.stop()
    assert healthy(live)


def test_an_empty_store_secret_refuses_start_up(
    demo_backend: TransformersBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match="store_secret is empty"):
        WindowConfig(store_secret="")
    monkeypatch.setenv("KAMERA_STORE_SECRET", "")
    with pytest.raises(SettingsError, match="KAMERA_STORE_SECRET is set but empty"):
        KameraServer(demo_backend, ServeSettings(MODEL, WindowConfig()))


@pytest.mark.parametrize(
    "address",
    [
        "2002:7f00:1::",  # 6to4 of 127.0.0.1
        "2002:c0a8:101::1",  # 6to4 of 192.168.1.1
        "2001:0:4136:e378:8000:63bf:80ff:fffe",  # Teredo whose client is 127.0.0.1
        "fec0::1",  # site-local
        "192.88.99.1",  # 6to4 relay anycast
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    ],
)
def test_addresses_that_carry_private_ones_are_refused(address: str) -> None:
    from kamera_agent.serve.fetch import _checked_address, public_address

    assert not public_address(address)
    with pytest.raises(ValueError, match="not a public address"):
        _checked_address(address, 80, allow_private=False)


def test_a_public_address_still_passes() -> None:
    from kamera_agent.serve.fetch import public_address

    assert public_address("93.184.216.34") and public_address("2002:5db8:d822::1")  # 6to4 of a public one
