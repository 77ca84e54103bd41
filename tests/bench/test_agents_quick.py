"""``kamera bench --suite agents --quick`` end to end, plus the scripts' own semantics.

Why a random demo model and a toy realistic shape: the suite's mechanics (every agent on every
side, op by op, the checks against re-prefill, the outputs) do not depend on trained weights
or on widths; exactness does not either: under `WindowConfig.exact` kamera must answer like
the model's own re-prefill on any weights, and the prefix cache is exact by construction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from kamera_agent.bench import runner
from kamera_agent.bench.agents.scripts import AGENTS, AgentCounts
from kamera_agent.bench.common import AGENT_NAMES, BenchOptions
from kamera_agent.chunks.chunk import Chunk

SIDES = {"kamera", "kamera-exact", "prefix"}


@pytest.fixture(scope="module")
def agents(untrained_demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick agents run through the bench runner; its results.json and report.md."""
    out = tmp_path_factory.mktemp("agents")
    options = BenchOptions(suite="agents", quick=True, model=untrained_demo_dir, out=out)
    outcome = runner.run_bench(options, Console(width=160, record=True))
    assert outcome.exit_code == 0
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    return {"results": results, "report": (out / "report.md").read_text()}


def _runs(agents: dict[str, Any]) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = agents["results"]["suites"]["agents"]["runs"]
    return runs


def test_every_agent_and_side_is_recorded(agents: dict[str, Any]) -> None:
    runs = _runs(agents)
    assert {(run["agent"], run["model"]) for run in runs} == {
        (agent, model) for agent in AGENT_NAMES for model in ("realistic", "demo")
    }
    for run in runs:
        assert set(run["sides"]) == SIDES
        assert run["steps_done"] == run["steps_requested"] == len(run["records"]) > 0
        for record in run["records"]:
            assert set(record["sides"]) == set(record["ops"]) == SIDES
            assert all(cost["ms"] > 0 for cost in record["sides"].values())
        assert len(run["checks"]) == run["steps_requested"]  # every step checked, not only questions
        assert sum(check["asked"] for check in run["checks"]) == run["asks_requested"] > 0
        for side in SIDES:
            assert run["sides"][side]["totals"]["tokens"] > 0
    for agent in AGENT_NAMES:
        assert f"## Agent {agent}" in agents["report"]
    claims = [t["claim"] for t in agents["results"]["targets"]]
    assert sum(claim.startswith(AGENT_NAMES) for claim in claims) == 5


def test_prefix_cache_matches_re_prefill(agents: dict[str, Any]) -> None:
    for run in _runs(agents):
        assert run["baseline_logit_error"] < 1e-4, run["agent"]  # final window, every model
        assert run["baseline_max_error"] < 1e-4, run["agent"]  # and every question on the demo model


def test_prefix_cache_runs_the_vision_tower_once_per_image(agents: dict[str, Any]) -> None:
    video = next(run for run in _runs(agents) if run["agent"] == "video" and run["model"] == "demo")
    frames = AgentCounts.quick().video_frames
    assert video["sides"]["prefix"]["totals"]["vision"] == frames  # slides re-prefill, never re-encode
    # never costlier (at the drift budget a slide's kept survivors are re-prefilled where they drift)
    assert video["sides"]["prefix"]["totals"]["tokens"] >= video["sides"]["kamera"]["totals"]["tokens"]


def test_exact_settings_answer_like_re_prefill_after_every_step(agents: dict[str, Any]) -> None:
    for run in _runs(agents):
        fidelity = run["sides"]["kamera-exact"]["fidelity"]
        assert fidelity["asks"] == run["asks_requested"]
        assert fidelity["checks"] == run["steps_requested"]
        assert fidelity["agreement"] == 1.0, run["agent"]
        assert fidelity["kl_max"] < 1e-6 and fidelity["final_kl"] < 1e-6, run["agent"]
        defaults, kl = run["sides"]["kamera"]["fidelity"], [c["kl"]["kamera"] for c in run["checks"]]
        assert defaults["kl_max"] == max(kl) and min(kl) <= defaults["kl_p90"] <= max(kl)
        if run["model"] == "demo":
            assert {check["reference"] for check in run["checks"]} == {"re-prefill"}


def test_a_push_only_stream_prefills_what_a_prefix_cache_does(agents: dict[str, Any]) -> None:
    for run in _runs(agents):
        if run["agent"] == "stream":
            totals = {side: run["sides"][side]["totals"]["tokens"] for side in SIDES}
            assert totals["kamera"] <= 1.05 * totals["prefix"], run["model"]


def test_time_to_first_token_is_measured_after_each_op(agents: dict[str, Any]) -> None:
    ttft = agents["results"]["suites"]["agents"]["ttft"]
    rows = {row["op"]: row for row in ttft["rows"]}
    assert len(rows) == 6 and all(row["ttft_ms"] > 0 and row["floor_ms"] > 0 for row in rows.values())
    # The last push's forward left the whole window in the kept cache; a push's and a stream
    # step's forwards likewise: the ask after them places nothing. (A swap served from stored
    # KV runs no forward: its ask places the swapped lines.)
    for prefix in ("first ask", "ask again", "push", "stream"):
        row = next(row for op, row in rows.items() if op.startswith(prefix))
        assert row["placed"] == 0, row
    assert "## Time to first token" in agents["report"]
    assert any(t["claim"].startswith("TTFT") for t in agents["results"]["targets"])


# -- the scripts themselves, without a model ------------------------------------------------------


class _Contents:
    """Chunks of a few tokens named by kind and index (enough for a script's lineup)."""

    def make(self, kind: str, index: int) -> Chunk:
        ids = torch.tensor([index, len(kind)])
        return Chunk(
            "text",
            f"{kind}-{index}",
            ids,
            torch.arange(2),
            2,
            torch.zeros(2, dtype=torch.long),
            label=f"{kind} {index}",
        )

    def question(self, index: int) -> str:
        return f"q{index}"


def test_web_replaces_the_oldest_screenshot_in_place() -> None:
    counts = AgentCounts.quick()
    script = AGENTS["web"](_Contents(), counts)
    before: tuple[str, ...] = ()
    for step in script.steps:
        shots = [label for label in step.lineup if label.startswith("screenshot")]
        assert len(shots) <= counts.web_screenshots
        if step.kind == "replace+append":
            gone = next(
                label for label in before if label.startswith("screenshot") and label not in step.lineup
            )
            caption = f"caption {gone.split()[-1]}"
            assert step.lineup.index(caption) == before.index(gone)  # the caption took its slot
        before = step.lineup
    assert len(script.steps) == counts.web_steps


def test_document_reads_coarse_to_fine_and_goes_back_in_reading_order() -> None:
    counts = AgentCounts.quick()
    script = AGENTS["document"](_Contents(), counts)
    pages = counts.document_pages
    backs = [step for step in script.steps if step.kind == "go back"]
    assert backs
    for step in script.steps[pages:]:
        assert [label for label in step.lineup[:pages]] == [f"overview {p}" for p in range(pages)]
        detailed = step.lineup[pages:]
        assert len(detailed) <= counts.document_working
        assert [int(label.split()[-1]) for label in detailed] == sorted(
            int(label.split()[-1]) for label in detailed
        )
    assert len(script.chunks) == 2 * pages


def test_video_slides_a_fifo_window() -> None:
    counts = AgentCounts.quick()
    script = AGENTS["video"](_Contents(), counts)
    last = script.steps[-1].lineup
    assert last == tuple(
        f"frame {i}" for i in range(counts.video_frames - counts.video_capacity, counts.video_frames)
    )
    assert script.asks == counts.video_frames // counts.ask_every
