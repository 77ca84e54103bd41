"""Progress for long bench and calibration runs: a live bar in a terminal, lines in a log.

Why lines: rich draws nothing while it runs on a console that is not a terminal (a run under
``nohup``, in CI, its output sent to a file), so an hours-long replay gave no sign of where it
was until it ended. Off a terminal each task writes a line at every tenth of its total, and at
least every minute while it advances, with its elapsed time and an estimate of what is left.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["LoggedProgress", "make_progress"]

LINE_EVERY = 60.0
"""Seconds at most between two lines of an advancing task off a terminal."""


def make_progress(console: Console, *, transient: bool = False) -> Progress:
    """The bar every long step reports to (a `LoggedProgress` where ``console`` is no terminal).

    Args:
        transient: the bars are cleared when done (a terminal's; lines in a log stay).
    """
    columns = (
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    if console.is_terminal:
        return Progress(*columns, console=console, transient=transient)
    return LoggedProgress(*columns, console=console, transient=True)


class LoggedProgress(Progress):
    """A `Progress` that also writes each task's advance as lines (for consoles that are no
    terminal, where rich draws nothing until the end)."""

    def __init__(self, *columns: Any, every: float = LINE_EVERY, **kwargs: Any) -> None:
        super().__init__(*columns, **kwargs)
        self._every = every
        self._written: dict[TaskID, tuple[float, int]] = {}
        """Per task: when its last line was written, and the tenth of its total it reported."""

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._write(task_id)

    def update(self, task_id: TaskID, **fields: Any) -> None:
        super().update(task_id, **fields)
        self._write(task_id)

    def _write(self, task_id: TaskID) -> None:
        task = next(task for task in self.tasks if task.id == task_id)
        if not task.total:
            return
        now = time.monotonic()
        tenth = int(10 * min(task.completed, task.total) / task.total)
        last, reported = self._written.get(task_id, (task.start_time or now, 0))
        if tenth <= reported and now - last < self._every:
            return
        self._written[task_id] = (now, tenth)
        left = task.time_remaining
        share = 100 * task.completed / task.total
        line = f"{task.description}: {task.completed:g}/{task.total:g} ({share:.0f} %), "
        line += f"{_clock(task.elapsed or 0.0)} elapsed"
        if left is not None and task.completed < task.total:
            line += f", about {_clock(left)} left"
        self.console.print(line, highlight=False, markup=False)


def _clock(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"
