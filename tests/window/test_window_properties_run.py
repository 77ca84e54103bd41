"""The window's property tests (tests/window/properties), run beside the rest of the suite.

They are the suite's longest tests; a process of their own lets them use the core the main
suite, on one torch thread, leaves idle (tests/side_envs.py). The README's test command runs
them (never skips them); ``pytest tests/window/properties`` runs them in the foreground.
"""

from __future__ import annotations

import sys

from tests.side_envs import finish


def test_the_window_properties_hold_in_a_process_of_their_own() -> None:
    output = finish("tests/window/test_window_properties_run.py")
    print(next(line for line in reversed(output.splitlines()) if " passed" in line), file=sys.stderr)
