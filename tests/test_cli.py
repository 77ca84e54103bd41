"""The ``kamera`` command: ``check`` on checkpoints the tests save, ``demo`` on the shipped model."""

from __future__ import annotations

from pathlib import Path

import pytest

from kamera_agent.check import run_check
from kamera_agent.cli import main
from tests.tiny_processors import save_tiny_text, save_tiny_vl


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_check_passes_on_a_vl_checkpoint(
    tmp_path: Path, family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    save_tiny_vl(tmp_path, family)
    assert main(["check", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 3 and "all checks passed" in out


def test_check_reports_each_measured_figure_on_a_text_checkpoint(tmp_path: Path) -> None:
    save_tiny_text(tmp_path, "llama")
    report = run_check(tmp_path)
    assert [v.name for v in report.verdicts] == ["relocation", "full-rank patch", "window vs generate"]
    assert report.passed
    assert 0 < report.verdicts[0].measured < 2e-5  # measured, not a constant


def test_operator_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--operator"]) == 0
    assert "Patch rank vs next-token KL" in capsys.readouterr().out


@pytest.fixture(scope="module")
def untrained_demo_model(untrained_demo_dir: Path) -> Path:
    return untrained_demo_dir


def test_demo_episode_runs_every_window_op(
    untrained_demo_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--model", str(untrained_demo_model)]) == 0
    out = capsys.readouterr().out
    for op in ("push legend", "push page", "reorder legend", "probe_without", "evict #1", "recall #1"):
        assert op in out


def test_demo_without_weights_falls_back_to_the_operator_demo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import kamera_agent.demo.model as demo_model

    monkeypatch.setattr(demo_model, "DEMO_MODEL_DIR", tmp_path / "missing")
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "weights are missing" in out and "Patch rank vs next-token KL" in out


def test_episode_recall_runs_no_forward(untrained_demo_model: Path) -> None:
    from kamera_agent.demo.episode import run_demo_episode

    result = run_demo_episode(model_path=untrained_demo_model)
    recall = next(step for step in result.steps if step.op == "recall #1")
    assert recall.cost.forwards == 0 and recall.cost.vision_encodes == 0
    assert recall.prefix_cache_tokens > 0
