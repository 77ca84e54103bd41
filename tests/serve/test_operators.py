"""What an operator of kamera serve can see, and what one tenant can learn of another: nothing.

The tenant probe is the issue's trial: tenant B sends tenant A's system prompt and messages, and
an image A sent, beside controls that differ only in one code or one image; B's ``cached_tokens``
must not tell them apart unless the server shares content on purpose. Live servers on
127.0.0.1, the official openai client.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import openai
import pytest

from kamera_agent.config import WindowConfig
from kamera_agent.errors import SettingsError
from kamera_agent.serve import ServeSettings
from tests.serve.conftest import MODEL, LiveServer, shot

Serve = Callable[..., LiveServer]

SYSTEM = "You are tenant A's screen agent. Project code 4417: answer in one word."
CONTROL = SYSTEM.replace("4417", "4418")  # one code apart, the same number of tokens
ACCESS = "kamera_agent.serve.access"


def _as(live: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0)


def _conversation(system: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": system},
        shot(0, "the first screen"),
        {"role": "assistant", "content": "noted"},
        {"role": "user", "content": "and now?"},
    ]


def _seen(client: openai.OpenAI, messages: list[dict[str, Any]], session: str) -> dict[str, Any]:
    """What one request, in a session of its own, says it reused: its cached and prompt tokens,
    the prompt by provenance, and every op's cost (vision encodes and canonicals included; not
    its seconds)."""
    response = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=1, extra_body={"session_id": session}
    )
    usage, kamera = response.usage, response.model_extra["kamera"]  # type: ignore[index]
    assert usage is not None and usage.prompt_tokens_details is not None
    ops = [{k: v for k, v in op.items() if "seconds" not in k} for op in kamera["ops"]]
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return {"cached": cached, "prompt": usage.prompt_tokens, "split": kamera["prompt"], "ops": ops}


@pytest.mark.parametrize("shared", [False, True], ids=["apart", "shared"])
def test_a_tenant_learns_nothing_of_another_tenants_content_unless_content_is_shared(
    serve: Serve, shared: bool
) -> None:
    live = serve(api_keys={"key-a": "a", "key-b": "b"}, share_content=shared)
    a, b = _as(live, "key-a"), _as(live, "key-b")
    _seen(a, _conversation(SYSTEM), "a-text")  # A's system prompt and messages
    system = {"role": "system", "content": SYSTEM}
    _seen(a, [system, shot(5, "what is this?")], "a-image")  # an image A sent
    text, text_control = (_seen(b, _conversation(s), f"b-{s[-20:]}") for s in (SYSTEM, CONTROL))
    _seen(b, [system, shot(9, "what is this?")], "b-warm")  # B's own entries under A's prompt first
    image, image_control = (_seen(b, [system, shot(i, "what is this?")], f"b-{i}") for i in (5, 6))
    assert text["prompt"] == text_control["prompt"] and image["prompt"] == image_control["prompt"]
    if shared:  # the side channel the flag opens, documented: A's content shows in B's usage
        assert text["cached"] > text_control["cached"] and image["cached"] > image_control["cached"]
    else:  # B's usage and kamera object the same for A's content as for content nobody sent
        assert text == text_control and image == image_control


def _get(live: LiveServer, path: str, key: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(live.url + path, headers=headers)) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def test_anonymous_health_says_alive_only_and_metrics_are_the_operators(serve: Serve) -> None:
    live = serve(api_keys={"key-a": "a", "key-b": "b"})
    _seen(_as(live, "key-a"), _conversation(SYSTEM), "a")
    assert json.loads(_get(live, "/health")[1]) == {"status": "ok"}  # no model, no session count
    assert json.loads(_get(live, "/health", "key-a")[1]) == {"status": "ok", "model": MODEL, "sessions": 1}
    assert json.loads(_get(live, "/health", "key-b")[1])["sessions"] == 0  # its own sessions only
    status, body = _get(live, "/metrics", "key-b")  # every tenant's traffic: not for a tenant
    assert status == 403 and "--metrics-key" in body
    operated = serve(api_keys={"key-a": "a", "key-b": "b"}, metrics_key="scrape")
    assert _get(operated, "/metrics", "key-a")[0] == 401
    assert _get(operated, "/metrics", "scrape")[0] == 200
    assert _get(serve(api_keys={"key-a": "a"}), "/metrics", "key-a")[0] == 200  # one tenant: its own
    with pytest.raises(SettingsError, match="empty"):  # "Authorization: Bearer" would pass
        ServeSettings(MODEL, WindowConfig(), metrics_key="")


def _access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(record.getMessage()) for record in caplog.records if record.name == ACCESS]


def _histogram_count(metrics: str, name: str) -> int:
    match = re.search(rf"^kamera:{name}_count (\d+)$", metrics, re.M)
    assert match, name
    infinite = re.search(rf'^kamera:{name}_bucket{{le="\+Inf"}} (\d+)$', metrics, re.M)
    assert infinite and infinite.group(1) == match.group(1)  # the buckets are cumulative
    return int(match.group(1))


def test_each_request_writes_one_access_line_and_the_latency_histograms_count_it(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    live = serve(api_keys={"key-a": "a"})
    a = _as(live, "key-a")
    with caplog.at_level(logging.INFO, logger=ACCESS):
        plain = a.chat.completions.create(model=MODEL, messages=_conversation(SYSTEM), temperature=0)
        streamed = a.chat.completions.create(
            model=MODEL, messages=_conversation(CONTROL), temperature=0, stream=True
        )
        assert [chunk for chunk in streamed]
        a.responses.create(model=MODEL, input="and now?", instructions=SYSTEM, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            a.chat.completions.create(model="nope", messages=_conversation(SYSTEM))
        with pytest.raises(openai.AuthenticationError):
            _as(live, "wrong").models.list()
        assert _get(live, "/health")[0] == 200
        metrics = _get(live, "/metrics", "key-a")[1]
    lines = _access_lines(caplog)
    assert [(line["method"], line["route"], line["status"]) for line in lines] == [
        ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/responses", 200),
        ("POST", "/v1/chat/completions", 404),
        ("GET", "/v1/models", 401),
        ("GET", "/health", 200),
        ("GET", "/metrics", 200),
    ]
    served, refused = lines[:3], lines[3:]
    assert served[0]["session"] == plain.model_extra["kamera"]["session_id"]  # type: ignore[index]
    assert served[0]["prompt_tokens"] == plain.usage.prompt_tokens  # type: ignore[union-attr]
    for line in served:
        assert line["tenant"] == "a" and line["session"].startswith("kam-")
        assert line["cached_tokens"] + line["prefilled_tokens"] == line["prompt_tokens"] > 0
        assert 0 < line["ttft_s"] <= line["total_s"]
    assert [line["tenant"] for line in refused] == ["a", None, None, "a"]
    assert all(line["prompt_tokens"] is None and line["total_s"] > 0 for line in refused)
    for name in (
        "time_to_first_token_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert _histogram_count(metrics, name) == 3, name  # the three served requests


def test_a_fault_is_a_500_whose_error_id_the_log_has_with_its_traceback(
    serve: Serve, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two faults: one in the model's worker (`KameraServer.complete`), one no route catches."""
    live = serve()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(live.server, "_claim", broken)
    monkeypatch.setattr(live.server.responses, "get", broken)
    with caplog.at_level(logging.INFO, logger="kamera_agent.serve"):
        with pytest.raises(openai.InternalServerError) as in_worker:
            live.client.chat.completions.create(model=MODEL, messages=_conversation(SYSTEM))
        status, escaped = _get(live, "/v1/responses/resp_x")
    bodies = [in_worker.value.body, json.loads(escaped)["error"]]
    assert status == 500 and in_worker.value.status_code == 500
    for body in bodies:
        error_id = body["error_id"]  # type: ignore[index]
        assert error_id in body["message"] and "RuntimeError" in body["message"]  # type: ignore[index]
        (logged,) = [r for r in caplog.records if r.levelno == logging.ERROR and error_id in r.getMessage()]
        assert logged.exc_info is not None and "a bug" in str(logged.exc_info[1])
        assert [line["error_id"] for line in _access_lines(caplog) if line.get("error_id") == error_id]
    assert _get(live, "/health")[0] == 200  # the server goes on
