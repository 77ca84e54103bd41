"""The README's Python snippets run, and their comments hold at the defaults.

tests/test_docs.py finds every snippet and says how each runs; the README's three run here: the
window in ten lines (on the shipped demo model in place of the checkpoint path, line by line, each
comment's claim checked against what the op reported), the offline snippet (it answers the
binding question right), and the `openai` snippet (against a `kamera serve` it starts).
"""

from __future__ import annotations

import contextlib
import io
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _block(after: str) -> str:
    match = re.search(re.escape(after) + r".*?```python\n(.*?)```", README.read_text(), re.S)
    assert match is not None, f"the README's snippet after {after!r} is missing"
    return match.group(1)


def test_the_window_in_ten_lines_does_what_its_comments_say() -> None:
    from kamera_agent.demo.model import DEMO_MODEL_DIR
    from kamera_agent.demo.task import make_items, render_page

    source = _block("## The window in ten lines")
    assert len(source.strip().splitlines()) <= 10
    source = source.replace('"path/to/Qwen2.5-VL-3B-Instruct"', repr(str(DEMO_MODEL_DIR)))
    item = make_items(1, seed=3)[0]
    namespace = {"image": render_page(item.pages[0]), "screenshot": render_page(item.pages[1])}
    lines = [line for line in source.splitlines() if line.strip()]
    exec("\n".join(lines[:2]), namespace)  # the import and the window
    window = namespace["window"]
    costs = []
    with contextlib.redirect_stdout(io.StringIO()):
        for line in lines[2:]:
            before = list(window.refs)
            exec(line, namespace)
            costs.append((before, window.stats.last))
    push, _, _, extend, slide, recall, _ = costs
    # "the vision tower runs once per image content": the frame, then the screenshot, once each
    assert push[1].vision_encodes == 1 and extend[1].vision_encodes == 1
    assert window.stats.total.vision_encodes == 2
    # "several new chunks, one forward"
    assert extend[1].forwards == 1
    # "the oldest chunk leaves": the frame, first in, is what recall brings back
    assert slide[0][0] == namespace["frame"] and namespace["frame"] not in recall[0]
    # "back from the store: no vision encode"
    assert recall[1].vision_encodes == 0 and namespace["frame"] in window.refs
    assert "tokens_prefilled" in repr(window.stats.total)


def test_the_offline_demo_snippet_answers_the_binding_question() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_block("Offline, on the shipped demo model"), "README.md", "exec"), {})
    answer, expected = out.getvalue().strip().split(" expected: ")
    assert answer.startswith(expected)


def test_the_openai_snippet_runs_against_kamera_serve() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from openai_agent import _wait_for
    finally:
        sys.path.remove(str(ROOT / "examples"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    source = _block("## Serving agents").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "kamera_agent", "--threads", "1", "serve", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_for(f"http://127.0.0.1:{port}/health", server, log, 300.0)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(source, "README.md", "exec"), {})
        finally:
            server.terminate()
            server.wait(timeout=20)
    printed = out.getvalue().splitlines()
    assert len(printed) >= 4 and printed[1].isdigit()
