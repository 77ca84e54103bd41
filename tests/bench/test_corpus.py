"""Real text for text models' episodes: the corpus's two halves never meet, passages are sized
like an agent's chunks, and a user's own files split the same way."""

from __future__ import annotations

from pathlib import Path

from kamera_agent.bench.corpus import _half, passages, read_passages
from kamera_agent.bench.window_suite import text_frames
from tests.window.backends import backend_named


def test_the_calibration_and_benchmark_halves_share_no_passage() -> None:
    calibration, benchmark = set(_half("calibration")), set(_half("benchmark"))
    assert len(calibration) > 300 and len(benchmark) > 300
    assert not calibration & benchmark
    sizes = sorted(len(p) for p in calibration | benchmark)
    assert sizes[len(sizes) // 2] > 240 and sizes[-1] < 1000  # ~60-200 tokens of prose each


def test_passages_are_drawn_in_a_seeded_order_and_repeat_once_all_are_used() -> None:
    assert passages("benchmark", 3, 10) == passages("benchmark", 3, 10)
    assert passages("benchmark", 3, 10) != passages("benchmark", 4, 10)
    every = passages("calibration", 1, 2 * len(_half("calibration")))
    assert set(every) == set(_half("calibration"))


def test_a_users_own_files_split_into_passages(tmp_path: Path) -> None:
    text = "\n\n".join(f"Paragraph {i}: " + "the river rose and the fields flooded. " * 4 for i in range(20))
    (tmp_path / "notes.txt").write_text(text)
    own = read_passages((tmp_path / "notes.txt",))
    assert len(own) >= 5 and all(120 <= len(p) <= 1000 for p in own)
    assert set(passages("calibration", 0, 50, [tmp_path / "notes.txt"])) == set(own)


def test_a_text_models_frames_are_passages_of_its_half() -> None:
    backend = backend_named("qwen2")
    frames = text_frames(backend, 7, 12, "calibration")  # type: ignore[arg-type]
    assert len({label for label, _ in frames}) == 12
    texts = {backend.encoder.tokenizer.decode(make().input_ids) for _, make in frames}
    assert texts <= set(_half("calibration"))
