"""`window.plan`: a dry run of any op, typed like the op itself.

    window.plan.reorder([c, a, b])        # the edits reorder would make, with their cost
    window.plan("reorder", [c, a, b])     # the same (sugar: the op named by a string)

Why it runs the op: a dry run must plan exactly what the op does, so each method is the op
itself, run with the window's `OpRunner` in dry mode: the op reads and checks its arguments as
always, and its transaction plans over the store as it is instead of executing. Nothing runs:
no forward, no store write, no store hit counted, no stats. Predicted forwards count a canonical
prefill only where the canonical is not stored; under probe-driven eviction an overflowing push
lists the probes it would run instead of running them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec

from kamera_agent.errors import WindowError
from kamera_agent.results import Plan
from kamera_agent.window.runner import OpRunner

if TYPE_CHECKING:
    from kamera_agent.window.window import KameraWindow

__all__ = ["PlanView"]

P = ParamSpec("P")


def _dry(runner: OpRunner, op: Callable[P, object]) -> Callable[P, Plan]:
    """``op`` as a dry run: the same arguments, its plan instead of its effect."""

    def planned(*args: P.args, **kwargs: P.kwargs) -> Plan:
        with runner.dry_run() as plans:
            op(*args, **kwargs)
        return plans[-1].public()

    planned.__doc__ = f"The plan of `{getattr(op, '__name__', 'op')}`, run dry (see `PlanView`)."
    return planned


class PlanView:
    """Dry runs of a window's ops: ``window.plan.<op>(...)``, or ``window.plan("<op>", ...)``."""

    OPS = ("push", "extend", "replace", "reorder", "slide", "evict", "recall", "arrange", "push_message")

    def __init__(self, window: KameraWindow, runner: OpRunner) -> None:
        self.push = _dry(runner, window.push)
        self.extend = _dry(runner, window.extend)
        self.replace = _dry(runner, window.replace)
        self.reorder = _dry(runner, window.reorder)
        self.slide = _dry(runner, window.slide)
        self.evict = _dry(runner, window.evict)
        self.recall = _dry(runner, window.recall)
        self.arrange = _dry(runner, window.arrange)
        self.push_message = _dry(runner, window.push_message)

    def __call__(self, op: str, *args: Any, **kwargs: Any) -> Plan:
        """The dry run of the op named ``op`` with its arguments (sugar for ``plan.<op>(...)``).

        Raises:
            WindowError: ``op`` is not one of `OPS`.
        """
        if op not in self.OPS:
            raise WindowError(f"unknown op {op!r}; plan one of {', '.join(self.OPS)}")
        planned: Callable[..., Plan] = getattr(self, op)
        return planned(*args, **kwargs)
