"""A window's life beyond single ops: closed windows refuse, concurrent callers are serialized.

Why: a closed window kept accepting pushes and questions (on a disk store nothing more was
written, silently), and two threads on one window raised raw tensor-shape errors from inside a
forward. A window now refuses every op after ``close()`` with `WindowClosedError`, and holds a
lock per op, so concurrent calls run one after another and the window ends exact (a 4-layer
model, `WindowConfig.exact()`, checked against the model's own re-prefill).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.config import WindowConfig
from kamera_agent.errors import KameraError, WindowClosedError
from kamera_agent.window import KameraWindow
from tests.window.backends import backend_named
from tests.window.helpers import answer_kl, chunk_errors

EXACT = 2e-5

_OPS: dict[str, Callable[[KameraWindow], Any]] = {
    "push": lambda w: w.push("one more"),
    "extend": lambda w: w.extend(["a", "b"]),
    "replace": lambda w: w.replace(w.refs[0], "instead"),
    "reorder": lambda w: w.reorder(w.refs[::-1]),
    "slide": lambda w: w.slide(1),
    "evict": lambda w: w.evict(w.refs[0]),
    "recall": lambda w: w.recall(w.evicted[0]),
    "arrange": lambda w: w.arrange(w.refs[::-1]),
    "forget": lambda w: w.forget(w.evicted[0]),
    "ask": lambda w: w.ask("what?", decode=DecodeConfig(max_new_tokens=1)),
    "probe": lambda w: w.probe_without(w.refs[0], "what?"),
    "kv": lambda w: w.kv(),
    "chunk_kv": lambda w: w.chunk_kv(w.refs[0]),
    "fork": lambda w: w.fork(),
    "plan": lambda w: w.plan.push("planned"),
}


@pytest.mark.parametrize("op", sorted(_OPS))
def test_a_closed_window_refuses_every_op_and_writes_nothing(op: str, tmp_path: Path) -> None:
    config = WindowConfig(disk_dir=tmp_path, disk_limit=1 << 26, evicted_pixels="retain")
    window = KameraWindow(backend_named("qwen2"), config=config)  # type: ignore[arg-type]
    window.extend(["the first note", "the second note", "the third note"])
    window.slide(1)
    window.close()
    files = sorted(p.name for p in tmp_path.rglob("*"))
    refs, evicted, total = window.refs, window.evicted, window.stats.total
    with pytest.raises(WindowClosedError, match="closed"):
        _OPS[op](window)
    assert sorted(p.name for p in tmp_path.rglob("*")) == files
    assert (window.refs, window.evicted, window.stats.total) == (refs, evicted, total)
    window.close()  # closing again is a no-op


def test_two_threads_on_one_window_are_serialized_and_it_ends_exact() -> None:
    """2 x 50 ops from two threads (pushes, slides, reorders, recalls, evictions, questions):
    each either runs whole or fails by name (a ref another thread just evicted), never a raw
    error; afterwards every chunk's KV is what a re-prefill computes."""
    backend = backend_named("qwen2")
    window = KameraWindow(backend, config=WindowConfig.exact(capacity_chunks=6))  # type: ignore[arg-type]
    window.extend([f"note {i} about the red ball" for i in range(4)])
    raw: list[BaseException] = []
    named: list[KameraError] = []
    start = threading.Barrier(2)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        for i in range(50):
            op = rng.choice(["push", "slide", "reorder", "recall", "evict", "ask"])
            try:
                refs, gone = window.refs, window.evicted
                if op == "push" or len(refs) < 3:
                    window.push(f"thread {seed} note {i}")
                elif op == "slide":
                    window.slide(1)
                elif op == "reorder":
                    window.reorder(rng.sample(refs, len(refs)))
                elif op == "recall" and gone:
                    window.recall(rng.choice(gone))
                elif op == "evict":
                    window.evict(rng.choice(refs))
                else:
                    window.ask("which note?", decode=DecodeConfig(max_new_tokens=1))
            except KameraError as error:  # the other thread changed the window under this call
                named.append(error)
            except BaseException as error:  # what the test is for
                raw.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    assert raw == []
    assert window.stats.total.forwards > 0 and len(window) >= 1
    errors = chunk_errors(window)
    assert max(errors.values()) <= EXACT, errors
    assert answer_kl(window) < 1e-9
