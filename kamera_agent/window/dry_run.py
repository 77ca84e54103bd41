"""`window.plan`: a dry run of any op, typed like the op itself.

    window.plan.reorder([c, a, b])        # the edits reorder would make, with their cost
    window.plan("reorder", [c, a, b])     # the same (sugar: the op named by a string)

Each method plans the very `Build` the op executes (`OpBuilders`), over the store as it is:
no forward, no store write, no store hit counted, no stats. Predicted forwards count a
canonical prefill only where the canonical is not stored; under probe-driven eviction an
overflowing push lists the probes it would run instead of running them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kamera_agent.chunks.chunk import ChunkKind
from kamera_agent.chunks.sources import ChannelOrder
from kamera_agent.errors import WindowError
from kamera_agent.results import Plan
from kamera_agent.window.builders import OpBuilders
from kamera_agent.window.runner import Build, OpRunner
from kamera_agent.window.setup import Item
from kamera_agent.window.state import ChunkRef

__all__ = ["PlanView"]


class PlanView:
    """Dry runs of a window's ops (``window.plan.<op>(...)``, or ``window.plan("<op>", ...)``)."""

    OPS = ("push", "extend", "replace", "reorder", "slide", "evict", "recall", "push_message")

    def __init__(self, runner: OpRunner, builders: OpBuilders) -> None:
        self._runner, self._builders = runner, builders

    def __call__(self, op: str, *args: Any, **kwargs: Any) -> Plan:
        """The dry run of the op named ``op`` with its arguments (sugar for ``plan.<op>(...)``).

        Raises:
            WindowError: ``op`` is not one of `OPS`.
        """
        if op not in self.OPS:
            raise WindowError(f"unknown op {op!r}; plan one of {', '.join(self.OPS)}")
        method = getattr(self, op)
        return method(*args, **kwargs)  # type: ignore[no-any-return]

    def push(
        self,
        item: Item,
        *,
        label: str | None = None,
        kind: ChunkKind | None = None,
        caption: str | None = None,
        channel_order: ChannelOrder | None = None,
    ) -> Plan:
        return self._plan(
            self._builders.push(item, label=label, kind=kind, caption=caption, channel_order=channel_order)
        )

    def extend(self, items: Sequence[Item], *, labels: Sequence[str | None] | None = None) -> Plan:
        return self._plan(self._builders.extend(items, labels=labels))

    def replace(
        self,
        ref: ChunkRef,
        item: Item,
        *,
        label: str | None = None,
        kind: ChunkKind | None = None,
        caption: str | None = None,
        channel_order: ChannelOrder | None = None,
        append: Sequence[Item] = (),
        append_labels: Sequence[str | None] | None = None,
    ) -> Plan:
        build = self._builders.replace(
            ref,
            item,
            label=label,
            kind=kind,
            caption=caption,
            channel_order=channel_order,
            append=append,
            append_labels=append_labels,
        )
        return self._plan(build)

    def reorder(self, refs: Sequence[ChunkRef]) -> Plan:
        return self._plan(self._builders.reorder(refs))

    def slide(self, n: int = 1) -> Plan:
        return self._plan(self._builders.slide(n))

    def evict(self, ref: ChunkRef, *more: ChunkRef) -> Plan:
        return self._plan(self._builders.evict(ref, *more))

    def recall(self, ref: ChunkRef, at: int | None = None) -> Plan:
        return self._plan(self._builders.recall(ref, at))

    def push_message(
        self,
        role: str,
        content: Any,
        *,
        opened: bool = True,
        closed: bool = True,
        labels: Sequence[str | None] | None = None,
    ) -> Plan:
        return self._plan(self._builders.message(role, content, opened=opened, closed=closed, labels=labels))

    def _plan(self, build: Build) -> Plan:
        return self._runner.dry_run(build).public()
