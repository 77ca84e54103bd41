"""The agents-replay suite: each policy sends what its agent sends, and a quick run drives both
servers through the official client end to end."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kamera_agent.replay.command import run_replay_command
from kamera_agent.replay.policies import POLICIES
from kamera_agent.replay.run import ReplaySummary, SideStep, StepRecord
from kamera_agent.replay.screens import TextScreens

SCREENS = TextScreens(seed=1, screen_tokens=8, output_tokens=8)


def _screens_shown(messages: list[dict[str, Any]]) -> list[str]:
    shown = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("text") in {SCREENS.screen(k)["text"] for k in range(40)}:
                shown.append(part["text"])
    return shown


def test_keep_3_batched_drops_old_screens_ten_at_a_time() -> None:
    counts = [len(_screens_shown(m)) for m in POLICIES["keep-3-batched"].requests(SCREENS, 24)]
    assert counts[:12] == list(range(1, 13))  # nothing dropped until 10 can go at once
    assert counts[12] == 3 and counts[21] == 12 and counts[22] == 3


def test_latest_8_keeps_eight_screens_and_their_messages_text() -> None:
    requests = POLICIES["latest-8"].requests(SCREENS, 20)
    assert [len(_screens_shown(m)) for m in requests][7:] == [8] * 13
    last = requests[-1]
    assert last[1]["content"] == [{"type": "text", "text": "Book a table for two at eight."}]  # text kept


def test_current_only_and_spliced_histories() -> None:
    current = POLICIES["current-only"].requests(SCREENS, 6)
    assert all(len(_screens_shown(m)) == 1 for m in current)
    spliced = POLICIES["latest-5-spliced"].requests(SCREENS, 9)
    firsts = [m[1]["content"] for m in spliced]
    assert len(set(firsts[4:])) == 5  # the first message changes every step once actions age out
    assert all(len(_screens_shown(m)) == min(5, i + 1) for i, m in enumerate(spliced))


def test_tool_truncated_ends_in_the_newest_output_and_stubs_old_ones() -> None:
    request = POLICIES["tool-truncated"].requests(SCREENS, 8)[-1]
    assert request[-1]["role"] == "tool"
    outputs = [m["content"] for m in request if m["role"] == "tool"]
    assert outputs[:-3] == ["(output dropped)"] * 5 and "(output dropped)" not in outputs[-3:]


def test_a_quick_replay_drives_both_servers_and_writes_its_table(tmp_path: Path) -> None:
    args = argparse.Namespace(
        quick=True, model=None, out=str(tmp_path), seed=7, chat_template=None, passes=None
    )
    assert run_replay_command(args, Console(file=None, width=200, quiet=True)) == 0
    stored = json.loads((tmp_path / "agents-replay.json").read_text())
    assert not stored["partial"] and stored["args"]["suite"] == "agents-replay" and stored["machine"]
    payload = stored["suites"]["agents-replay"]
    assert {(s["model"], s["policy"]) for s in payload["summaries"]} == {
        (model, policy) for model in ("demo", "realistic") for policy in POLICIES
    }
    for record in payload["records"]:
        assert record["kamera"]["prompt_tokens"] == record["prefix"]["prompt_tokens"]  # the same request
        assert 0 < record["prefix"]["prefilled"] <= record["prefix"]["prompt_tokens"]
        for side in ("kamera", "prefix"):
            assert 0 < record[side]["forward_seconds"] < record[side]["seconds"]  # its forwards timed
    passes = payload["passes"]
    assert passes == 2 and {r["pass"] for r in payload["records"]} == {0, 1}
    for summary in payload["summaries"]:
        assert summary["passes"] == passes and len(summary["pass_walls"]) == passes
        assert summary["wall_over_prefix"] > 0 and summary["in_forwards"] > 0
        assert summary["rest_ms"]["kamera"] > 0 and summary["rest_ms"]["prefix"] > 0
        steps = [
            r
            for r in payload["records"]
            if (r["model"], r["policy"]) == (summary["model"], summary["policy"])
        ]
        assert summary["tokens"]["prefix"] == sum(r["prefix"]["prefilled"] for r in steps if r["pass"] == 0)
        for number in range(passes):  # each pass on fresh servers: the same tokens every pass
            assert [r["kamera"]["prefilled"] for r in steps if r["pass"] == number] == [
                r["kamera"]["prefilled"] for r in steps if r["pass"] == 0
            ]
    assert (tmp_path / "agents-replay.md").read_text().count("\n") == 2 + 2 * len(POLICIES)


def _side(seconds: float, forward: float, prefilled: int = 10, answer: str = "a") -> SideStep:
    return SideStep(seconds, forward, prompt_tokens=10, prefilled=prefilled, answer=answer)


def test_the_wall_figure_is_the_median_of_per_step_ratios_over_every_pass() -> None:
    """One step slowed by a burst of load moves a total's ratio, not the median of the steps'."""
    ratios = [(1.0, 1.0), (1.0, 1.02), (2.0, 1.0), (1.0, 1.0), (0.98, 1.0), (1.0, 1.0)]
    rows = [
        StepRecord("m", "p", step % 3, {"kamera": _side(k, 0.9 * k), "prefix": _side(p, 0.9 * p)}, step // 3)
        for step, (k, p) in enumerate(ratios)
    ]
    summary = ReplaySummary.of(rows)
    assert (summary.steps, summary.passes, summary.tokens) == (3, 2, {"kamera": 30, "prefix": 30})
    assert summary.wall_over_prefix == pytest.approx(1.0)  # the burst (2.0×) is one step of six
    assert summary.pass_walls == pytest.approx(((1.0 + 1.0 + 2.0) / 3.02, 2.98 / 3.0))
    assert summary.rest_ms["kamera"] == pytest.approx(100.0) and summary.in_forwards == pytest.approx(1.0)


def test_a_text_model_is_replayed_alone_with_accessibility_tree_screens(
    tiny_text_model_dir: Path, tmp_path: Path
) -> None:
    args = argparse.Namespace(
        quick=True, model=str(tiny_text_model_dir), out=str(tmp_path), seed=7, chat_template=None, passes=1
    )
    assert run_replay_command(args, Console(file=None, width=200, quiet=True)) == 0
    stored = json.loads((tmp_path / "agents-replay.json").read_text())
    payload = stored["suites"]["agents-replay"]
    assert {s["model"] for s in payload["summaries"]} == {tiny_text_model_dir.name} and payload["passes"] == 1
    assert {s["policy"] for s in payload["summaries"]} == set(POLICIES)
    for record in payload["records"]:
        assert record["kamera"]["prompt_tokens"] == record["prefix"]["prompt_tokens"]
        assert 0 < record["prefix"]["prefilled"] <= record["prefix"]["prompt_tokens"]
        assert (
            record["kamera"]["prefilled"] <= record["prefix"]["prefilled"]
        )  # never more than a prefix cache


def test_a_text_models_screens_are_accessibility_trees_at_their_lengths() -> None:
    from kamera_agent.backends.transformers import TransformersBackend
    from kamera_agent.bench.agents.text_contents import TEXT_LENGTHS, TextContents
    from kamera_agent.replay.screens import TreeScreens
    from tests.backends.test_transformers_backend import sharpen
    from tests.tiny_models import tiny_llama
    from tests.tiny_processors import tiny_tokenizer

    encoder = TransformersBackend(sharpen(tiny_llama()), tokenizer=tiny_tokenizer()).encoder
    screens = TreeScreens(TextContents(encoder, TEXT_LENGTHS, 3))
    for step in range(4):
        screen = screens.screen(step)["text"]
        assert screen.startswith("window ") and "  banner" in screen
        assert 300 <= len(encoder.tokens(screen)) <= 800  # a character a token
        assert 200 <= len(encoder.tokens(screens.output(step))) <= 2000
        assert len(encoder.tokens(screens.action(step))) <= 24
