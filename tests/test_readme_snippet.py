"""The README's offline snippet on the shipped demo model runs and answers right."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_offline_demo_snippet_answers_the_binding_question() -> None:
    text = README.read_text()
    match = re.search(r"Offline, on the shipped demo model.*?```python\n(.*?)```", text, re.S)
    assert match is not None, "the README's offline snippet is missing"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(match.group(1), "README.md", "exec"), {})
    answer, expected = out.getvalue().strip().split(" expected: ")
    assert answer.startswith(expected)
