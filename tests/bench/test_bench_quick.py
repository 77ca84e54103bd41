"""``kamera bench --suite all --quick`` end to end, on a randomly initialised kamera-tiny-vl.

Why a random model: the suites' mechanics (every arm on the same items, both sides of every
comparison, the outputs and their structure) do not depend on training, and the test must
not wait for the shipped weights. Figures are checked for sanity, not for the targets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kamera_agent.bench import runner
from kamera_agent.bench.common import BenchOptions
from kamera_agent.bench.cost import CostRun, CostShape
from kamera_agent.bench.fidelity import FIDELITY_ARMS
from kamera_agent.bench.floor import FLOORS
from kamera_agent.bench.frontier import ROWS
from kamera_agent.bench.window_suite import RECOMPUTE


@pytest.fixture(scope="module")
def demo_dir(untrained_demo_dir: Path) -> Path:
    return untrained_demo_dir


@pytest.fixture(scope="module")
def quick_run(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """One ``kamera bench --suite all --quick`` through the command's own parser and runner."""
    parser = argparse.ArgumentParser(prog="kamera")
    runner.add_bench_parser(parser.add_subparsers(dest="command"))
    out = tmp_path_factory.mktemp("bench-results")
    args = parser.parse_args(
        ["bench", "--suite", "all", "--quick", "--model", str(demo_dir), "--out", str(out)]
    )
    code = runner.run_bench_command(args, Console(width=160, record=True))
    return code, out


def _results(out: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((out / "results.json").read_text())
    return loaded


def test_quick_run_writes_every_output(quick_run: tuple[int, Path]) -> None:
    code, out = quick_run
    assert code == 0
    results = _results(out)
    assert {"schema", "partial", "machine", "seeds", "args", "suites", "targets"} <= results.keys()
    assert results["partial"] is False and results["args"]["quick"] is True
    assert {"platform", "processor", "cpu_count", "torch", "transformers", "torch_threads"} <= results[
        "machine"
    ].keys()
    assert set(results["suites"]) == {"fidelity", "cost", "window", "agents"}
    assert (
        len(results["targets"]) == 16
    )  # fidelity 2, the demo model 6, cost 2, agents 5, time to first token 1
    report = (out / "report.md").read_text()
    for title in ("Fidelity", "Cost", "Window frontier", "Agent stream", "Targets"):
        assert f"## {title}" in report


def test_fidelity_arms_are_sane(quick_run: tuple[int, Path]) -> None:
    fidelity = _results(quick_run[1])["suites"]["fidelity"]
    assert fidelity["items_done"] == fidelity["items_requested"] == 24
    arms = {arm["arm"]: arm for arm in fidelity["arms"]}
    assert set(arms) == {"reprefill", *FIDELITY_ARMS}
    assert arms["reprefill"]["kl"] == 0.0
    assert arms["full"]["kl"] < 1e-6 and arms["full"]["top1_agreement"] == 1.0
    assert arms["blind"]["kl"] > 0
    assert arms["full"]["eta"] == pytest.approx(1.0, abs=1e-3)
    for arm in arms.values():
        assert 0.0 <= arm["accuracy"] <= 1.0 and arm["kl"] >= 0.0


def test_cost_rows_are_sane(quick_run: tuple[int, Path]) -> None:
    cost = _results(quick_run[1])["suites"]["cost"]
    assert [row["tokens"] for row in cost["rows"]] == list(CostShape.quick().lengths)
    for row in cost["rows"]:
        assert row["ratio"] > 0 and row["reuse_ms"] > 0 and row["reprefill_ms"] > 0
        assert row["full_rank_logit_error"] < 1e-4  # the timed reuse path is exact at full rank
        assert 0 < row["patch_bytes"]["4"] < row["patch_bytes"]["64"]


def test_window_frontier_runs_every_row_on_the_same_episode(quick_run: tuple[int, Path]) -> None:
    window = _results(quick_run[1])["suites"]["window"]
    assert window["ops_requested"] == BenchOptions(quick=True).op_count
    assert [run["row"] for run in window["runs"]] == list(ROWS)
    assert [row["row"] for row in window["frontier"]] == ["prefix cache", *ROWS, *RECOMPUTE, *FLOORS]
    episodes = {tuple(r["op"] for r in run["records"]) for run in window["runs"]}
    assert len(episodes) == 1  # every row on the same ops (the frontier's own test checks the figures)
    floors = {row["row"]: row for row in window["frontier"] if row["row"] in FLOORS}
    assert all(0 < row["kl_mean"] < 1e-1 for row in floors.values())  # bf16 and fp16 are not fp32


def test_ctrl_c_leaves_partial_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(context: Any, progress: Any) -> None:
        context.results.cost = CostRun(CostShape.quick(), threads=1, quick=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "SUITES", {"cost": interrupted})
    outcome = runner.run_bench(BenchOptions(suite="cost", quick=True, out=tmp_path), Console(width=160))
    assert outcome.exit_code == runner.INTERRUPTED == 130
    results = _results(tmp_path)
    assert results["partial"] is True and results["interrupted_in"] == "cost"
    assert results["suites"]["cost"]["rows"] == []
    assert (tmp_path / "report.md").read_text().count("Partial run") == 1


def test_missing_model_fails_before_any_suite_runs(tmp_path: Path) -> None:
    options = BenchOptions(suite="window", model=tmp_path / "absent", out=tmp_path / "out")
    outcome = runner.run_bench(options, Console(width=160))
    assert outcome.exit_code == runner.USAGE_ERROR and outcome.files == []
    assert not (tmp_path / "out").exists()
