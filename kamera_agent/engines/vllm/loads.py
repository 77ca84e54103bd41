"""Loads off vLLM's step: vLLM's asynchronous-load contract, served by one background thread.

Why: a load reads the store (a shared tier's round trips, deserializing, checking its digest),
relocates the chunk's keys to the request's positions and writes vLLM's blocks. Done inside
``start_load_kv`` it holds up the step, and every request in it. vLLM 0.32 lets a connector load
asynchronously: ``get_num_new_matched_tokens`` answers ``(n, True)``, vLLM allocates the blocks
and parks the request (``WAITING_FOR_REMOTE_KVS``, its blocks not yet in the prefix cache, so no
other request reads them), ``start_load_kv`` starts the loads after the step's forward is
launched, and the worker's ``get_finished`` names the requests whose loads are done; vLLM
schedules each in the step after, failed blocks (``get_block_ids_with_load_errors``, reported in
the same step as the request) computed under its ``kv_load_failure_policy``.

    start_load_kv ──one job per step──► thread: read, relocate, write (every load of the job)
    get_finished ◄── requests done, with their written / failed loads and failed blocks

Every load submitted is reported finished, written or failed, never dropped: vLLM keeps the
request parked until then. On CUDA the writes run on a stream of the thread's own, synchronized
before the request is reported.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kamera_agent.engines.faults import HookFaults
from kamera_agent.store import EntryKey
from kamera_agent.threads import WorkerThread

__all__ = ["BackgroundLoads", "Load", "LoadId", "LoadResults"]

LoadId = tuple[str, int]
"""A load's name on both sides: its request and the first request token it writes."""


@dataclass(frozen=True)
class Load:
    """One span of a chunk to write: ``kv[entry_from:entry_to]`` of ``entry`` at request tokens
    ``start..``."""

    req_id: str
    entry: EntryKey | None
    """``None``: blocks offered that cannot be loaded (a fault after the offer): reported failed."""
    entry_from: int
    entry_to: int
    start: int
    slots: tuple[int, ...]
    positions: torch.Tensor | None = field(default=None, compare=False)
    """The tokens' M-RoPE positions ``[3, entry_to - entry_from]``
    (`kamera_agent.engines.vllm.mrope`); ``None``: their indices ``start..``."""


@dataclass
class LoadResults:
    """What finished since the last `BackgroundLoads.take`."""

    finished: set[str] = field(default_factory=set)
    """Requests whose every load is done (written or failed)."""
    written: set[LoadId] = field(default_factory=set)
    failed: set[LoadId] = field(default_factory=set)
    errors: set[int] = field(default_factory=set)
    """vLLM blocks a failed load left unwritten."""


class BackgroundLoads:
    """One daemon thread running loads in the order they were submitted. Thread-safe.

    Args:
        load: writes one load into vLLM's blocks; ``True`` when written (``False`` or an
            exception: failed, its blocks reported).
        faults: where a load's exception is counted (hook ``start_load_kv``).
        block_size: vLLM's block size (slots to blocks).
    """

    def __init__(self, load: Callable[[Load], bool], faults: HookFaults, block_size: int) -> None:
        self._load, self._faults, self._block_size = load, faults, block_size
        self._jobs: deque[list[Load]] = deque()
        self._done = LoadResults()
        self._worker = WorkerThread("kamera-vllm-loads", self._run)
        self._lock = self._worker.lock
        self._stream: Any = None

    def submit(self, loads: Sequence[Load]) -> None:
        """Start ``loads`` (one step's); their requests are reported by a later `take`."""
        if not loads:
            return
        with self._lock:
            if self._worker.closed:  # shutting down: every load fails, every request is still reported
                self._record(list(loads), [False] * len(loads))
                return
            self._jobs.append(list(loads))
            self._worker.busy += 1
            self._worker.start_once()
            self._lock.notify_all()

    def take(self) -> LoadResults:
        """What finished since the last call (and forget it)."""
        with self._lock:
            done, self._done = self._done, LoadResults()
        return done

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every submitted load is done (at most ``timeout`` seconds); whether they are."""
        return self._worker.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish what was submitted (within ``timeout``) and stop the thread."""
        self._worker.close(timeout)

    def _run(self) -> None:
        for job in self._worker.items(self._jobs):
            outcomes = [self._one(load) for load in job]
            if self._stream is not None:
                self._stream.synchronize()  # written before vLLM is told
            with self._lock:
                self._record(job, outcomes)
                self._worker.busy -= 1
                self._lock.notify_all()

    def _one(self, load: Load) -> bool:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                if self._stream is None:
                    self._stream = torch.cuda.Stream()
                with torch.cuda.stream(self._stream):
                    return self._load(load)
            return self._load(load)
        except Exception as exc:  # any fault: these blocks are reported failed, vLLM computes them
            self._faults.caught("start_load_kv", exc)
            return False

    def _record(self, job: list[Load], outcomes: list[bool]) -> None:
        """Under the lock: the job's loads done, its requests finished."""
        for load, written in zip(job, outcomes, strict=True):
            (self._done.written if written else self._done.failed).add((load.req_id, load.start))
            if not written:
                self._done.errors |= {slot // self._block_size for slot in load.slots}
            self._done.finished.add(load.req_id)
