"""Progress off a terminal: lines a log shows while a long run goes on, not only at its end."""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import Progress

from kamera_agent.bench.progress import LoggedProgress, make_progress


def test_off_a_terminal_each_tenth_of_a_task_is_a_line_with_its_time() -> None:
    log = io.StringIO()
    with make_progress(Console(file=log, width=200)) as progress:
        assert isinstance(progress, LoggedProgress)
        task = progress.add_task("replay · model · latest-8", total=20)
        for _ in range(20):
            progress.advance(task)
        other = progress.add_task("no total")  # nothing to measure it by: no lines
        progress.advance(other)
    lines = [line for line in log.getvalue().splitlines() if line.startswith("replay · model · latest-8: ")]
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == [f"{2 * n}/20" for n in range(1, 11)]
    assert "0:00:00 elapsed" in lines[0] and "left" not in lines[-1] and "(100 %)" in lines[-1]
    assert "no total:" not in log.getvalue()


def test_a_slow_task_writes_a_line_at_least_every_so_often() -> None:
    log = io.StringIO()
    with LoggedProgress(console=Console(file=log, width=200), every=0.0) as progress:
        task = progress.add_task("calibration", total=1000)
        for _ in range(3):
            progress.advance(task)
    assert log.getvalue().count("calibration: ") == 3  # each advance past the interval: a line


def test_in_a_terminal_the_bar_is_rich_s_own() -> None:
    progress = make_progress(Console(file=io.StringIO(), force_terminal=True))
    assert type(progress) is Progress
