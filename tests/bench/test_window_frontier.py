"""``kamera bench --suite window`` on a few ops: every frontier row, measured after every op.

Why a random demo model: the frontier's mechanics (the same episode under every setting, the
measurement after every op against the model's own re-prefill, the columns adding up to the
per-op records) do not depend on training, and exactness does not either: the prefix cache is
exact by construction and `WindowConfig.exact()` must answer like re-prefill on any weights.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kamera_agent.bench import runner
from kamera_agent.bench.floor import FLOORS
from kamera_agent.bench.frontier import ROWS
from kamera_agent.bench.window_suite import KAMERA, PREFIX, RECOMPUTE

OPS = 10


@pytest.fixture(scope="module")
def frontier(untrained_demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``kamera bench --suite window --ops 10`` through the command's own parser and runner."""
    parser = argparse.ArgumentParser(prog="kamera")
    runner.add_bench_parser(parser.add_subparsers(dest="command"))
    out = tmp_path_factory.mktemp("frontier")
    args = parser.parse_args(
        [
            "bench",
            "--suite",
            "window",
            "--ops",
            str(OPS),
            "--model",
            str(untrained_demo_dir),
            "--out",
            str(out),
        ]
    )
    assert runner.run_bench_command(args, Console(width=200, record=True)) == 0
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    return {"window": results["suites"]["window"], "report": (out / "report.md").read_text()}


def _rows(frontier: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["row"]: row for row in frontier["window"]["frontier"]}


def _runs(frontier: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {run["row"]: run for run in frontier["window"]["runs"]}


def test_every_row_runs_the_same_episode_and_is_measured_after_every_op(frontier: dict[str, Any]) -> None:
    runs = _runs(frontier)
    assert list(runs) == list(ROWS)
    episodes = {tuple((r["op"], r["detail"]) for r in run["records"]) for run in runs.values()}
    assert len(episodes) == 1  # same seed, same ops, whatever the setting
    for run in runs.values():
        assert run["ops_done"] == OPS == len(run["records"])
        for record in run["records"]:
            assert set(record["sides"]) == {KAMERA, *ROWS[run["row"]].followers}
            for spent in record["sides"].values():
                assert spent["kl"] is not None and spent["kl"] >= 0
                assert spent["ask_forwards"] == 1  # the question formed nothing the op deferred
    assert list(_rows(frontier)) == [PREFIX, *ROWS, *RECOMPUTE, *FLOORS]
    assert "## Window frontier" in frontier["report"]


def test_the_exact_row_is_window_config_exact_at_full_rank(frontier: dict[str, Any]) -> None:
    config = _runs(frontier)["exact"]["config"]
    assert config["rank"] == "full" and config["survivors"] == "removal" and config["orbit"] is False
    assert config["recall_context"] == "current" and config["cascade"] == "cascade"
    assert _runs(frontier)["defaults"]["changed"] == "the defaults"
    assert _runs(frontier)["blind"]["config"]["rank"] == 0


def test_the_prefix_cache_and_the_exact_row_answer_like_re_prefill(frontier: dict[str, Any]) -> None:
    rows = _rows(frontier)
    prefix, exact = rows[PREFIX], rows["exact"]
    assert prefix["ops"] == OPS * len(ROWS)  # pooled over every run it ran beside
    assert prefix["kl_max"] < 1e-6 and prefix["agreement"] == 1.0 and prefix["max_logit_error"] < 1e-4
    assert exact["kl_max"] < 1e-6 and exact["agreement"] == 1.0
    assert rows["blind"]["kl_mean"] > exact["kl_mean"]  # rank 0 is not exact on a binding model's layout


def test_the_columns_add_up_to_the_per_op_records(frontier: dict[str, Any]) -> None:
    rows, runs = _rows(frontier), _runs(frontier)
    prefix_tokens = {sum(r["sides"][PREFIX]["tokens"] for r in run["records"]) for run in runs.values()}
    assert len(prefix_tokens) == 1 and rows[PREFIX]["tokens"] == prefix_tokens.pop()
    for name, run in runs.items():
        row, records = rows[name], run["records"]
        for column in ("tokens", "forwards", "vision", "ms", "ask_ms"):
            assert row[column] == pytest.approx(sum(r["sides"][KAMERA][column] for r in records)), column
            assert run["totals"][KAMERA][column] == pytest.approx(row[column])
        prefix_ms = sum(r["sides"][PREFIX]["ms"] for r in records)
        assert row["prefix_ms"] == pytest.approx(prefix_ms)
        assert row["wall_ratio"] == pytest.approx(row["ms"] / prefix_ms)
        kl = sorted(r["sides"][KAMERA]["kl"] for r in records)
        assert row["kl_mean"] == pytest.approx(sum(kl) / len(kl))
        assert row["kl_max"] == kl[-1] and kl[0] <= row["kl_p90"] <= kl[-1]
        agrees = [r["sides"][KAMERA]["agrees"] for r in records]
        assert row["agreement"] == pytest.approx(sum(agrees) / len(agrees))
        assert math.isfinite(row["wall_ratio_with_asks"])


def test_the_recompute_sweep_runs_beside_the_exact_row_and_costs_more_as_it_recomputes_more(
    frontier: dict[str, Any],
) -> None:
    """5 to 60 % in 5 % steps, each a row of its own: more recompute costs more tokens (same
    probes, more selected rows), and every figure comes from the exact run's records."""
    rows, exact = _rows(frontier), _runs(frontier)["exact"]
    assert tuple(f"recompute {p}%" for p in range(5, 65, 5)) == RECOMPUTE
    tokens = [rows[name]["tokens"] for name in RECOMPUTE]
    assert tokens == sorted(tokens) and tokens[0] < tokens[-1]
    for name in RECOMPUTE:
        row, records = rows[name], exact["records"]
        assert row["changed"] == "beside exact" and row["ops"] == OPS
        assert row["tokens"] == sum(r["sides"][name]["tokens"] for r in records)
        assert row["prefix_ms"] == pytest.approx(rows["exact"]["prefix_ms"])
