"""docs/results.md and the README's headline table are what the stored runs say: regenerated
from docs/results/*.json, they must equal what is committed (edit a figure by hand and this fails)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kamera_agent.bench.published import (
    HEADLINE,
    RESULTS,
    headline_block,
    headline_table,
    publish,
    render_results,
    stored_runs,
)
from kamera_agent.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_docs_results_md_is_what_the_stored_runs_say() -> None:
    runs = stored_runs(ROOT)
    assert HEADLINE in runs, f"{RESULTS / HEADLINE} is the README headline's run"
    assert (ROOT / "docs" / "results.md").read_text() == render_results(runs), (
        "docs/results.md differs from the stored runs: run `kamera bench --report` from the repository root"
    )


def test_the_readmes_headline_table_is_the_stored_run_of_the_defaults_on_a_real_model() -> None:
    run = stored_runs(ROOT)[HEADLINE]
    assert run["args"]["model"] and "smollm2" in run["args"]["model"].lower()  # a real model
    assert headline_block((ROOT / "README.md").read_text()) == headline_table(run)
    assert "| defaults |" in headline_table(run) and "| prefix cache |" in headline_table(run)


def test_the_report_command_writes_both_from_the_stored_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(ROOT / RESULTS, tmp_path / RESULTS)
    (tmp_path / "README.md").write_text(
        "# x\n<!-- results:headline (kamera bench --report writes this table) -->\nstale\n"
        "<!-- /results:headline -->\nafter\n"
    )
    run = json.loads((tmp_path / RESULTS / HEADLINE).read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--report"]) == 0
    assert headline_block((tmp_path / "README.md").read_text()) == headline_table(run)
    assert (tmp_path / "README.md").read_text().endswith("after\n")
    assert publish(tmp_path) == [tmp_path / "docs" / "results.md"]  # nothing left to change in the README
