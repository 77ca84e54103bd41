"""A long bench run stops as Ctrl-C stops it on SIGTERM, and on SIGINT where it started ignored
(a background job of a non-interactive shell), writing what finished; the handlers come back."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

SCRIPT = """
import os, signal, sys, time
from kamera_agent.bench.stopping import interruptible
sig = getattr(signal, sys.argv[1])
if sys.argv[2] == "ignored":
    signal.signal(sig, signal.SIG_IGN)
before = signal.getsignal(sig)
try:
    with interruptible():
        os.kill(os.getpid(), sig)
        time.sleep(5)
    print("not stopped")
except KeyboardInterrupt as stop:
    print("stopped:", stop)
print("restored" if signal.getsignal(sig) == before else "not restored")
"""


@pytest.mark.parametrize(
    ("name", "start"), [("SIGTERM", "default"), ("SIGINT", "default"), ("SIGINT", "ignored")]
)
def test_a_signal_ends_the_run_as_ctrl_c_does_and_the_handler_comes_back(name: str, start: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, name, start], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"stopped: stopped by {name}", "restored"]


def test_off_the_main_thread_nothing_changes() -> None:
    import threading

    from kamera_agent.bench.stopping import interruptible

    seen: list[object] = []

    def run() -> None:
        with interruptible():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [before]
