"""`kamera calibrate`: a calibration fitted on a model's own episodes, filed by its fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.progress import Progress

from kamera_agent.bench import calibrate as calibrate_module
from kamera_agent.bench.calibrate import _signals, episodes, fit_calibration, judge
from kamera_agent.cli import main
from kamera_agent.core.drift import CALIBRATION_DIR_VARIABLE, find_calibration
from kamera_agent.window import KameraWindow
from tests.window.backends import backend_named


def test_a_text_models_calibration_bounds_its_quantile_of_fitting_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A text-only model calibrates on passages of real text (its half of the corpus); the fitted
    scale bounds 99 % of the approximated chunks it was fitted on; exact chunks are never fitted.
    A window of 4 (the byte tokenizer makes a passage ~350 tokens)."""
    monkeypatch.setattr(calibrate_module, "CAPACITY", 4)
    backend = backend_named("qwen2")
    with Progress(disable=True) as progress:
        ops = episodes(backend, [1, 2], 16, progress, 0.2)
    assert any(not slot.exact for op in ops for slot in op)  # the unbounded policies approximated
    assert all(slot.own == 0.0 for op in ops for slot in op if slot.exact)
    calibration = fit_calibration(backend.fingerprint, ops, [1, 2], 0.2)
    pairs = _signals(ops, calibration.inherit)
    bounded = sum(error <= calibration.scale * signal + 1e-12 for signal, error in pairs)
    assert bounded >= 0.99 * len(pairs) and calibration.samples == len(pairs)
    judged = judge(calibration, ops)
    assert -1 <= judged.spearman <= 1 and judged.within[0.1] >= judged.within[0.01] >= judged.within[0.001]


def test_kamera_calibrate_files_the_demo_models_calibration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CALIBRATION_DIR_VARIABLE, str(tmp_path))
    assert main(["calibrate", "demo", "--ops", "24", "--seeds", "5", "--out", str(tmp_path)]) == 0
    (filed,) = tmp_path.glob("*.json")
    data = json.loads(filed.read_text())
    assert data["seeds"] == [5] and data["samples"] > 0 and data["scale"] > 0
    # the episode ran again at the default budget: its ops' fix counts ship with the calibration
    rates = data["fix_rates"]
    assert rates and all(0 <= fixed <= audited for audited, fixed in rates.values())
    assert sum(audited for audited, _ in rates.values()) > 0
    from kamera_agent.demo.model import load_demo_model

    model, tokenizer, image_processor = load_demo_model()
    window = KameraWindow(model, tokenizer=tokenizer, image_processor=image_processor)
    found = find_calibration(window.backend.fingerprint)
    assert found is not None and found.seeds == (5,)  # the user's directory comes before the shipped one
    assert window.budget == found.budget
    assert "filed at" in capsys.readouterr().out
