"""The episodes a drift calibration is fitted on: the window suite's ops with the policies
unbounded, each approximated chunk measured against the model's own re-prefill.

Why the window suite's episodes, and why the answer too: `kamera_agent.bench.calibrate` says.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress, TaskID

from kamera_agent.backends.base import DecodeConfig, Reference
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.calibration_fit import Slot, Step, fit_calibration
from kamera_agent.bench.corpus import question
from kamera_agent.bench.floor import Floor, native_bf16
from kamera_agent.bench.truth import Truth
from kamera_agent.bench.window_suite import QUERY, _Episode, _items, text_frames
from kamera_agent.config import WindowConfig
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.divergence import next_token_kl
from kamera_agent.fidelity import (
    Calibration,
    DriftBudget,
    Measure,
    absorbed_gone,
    audit_indices,
    find_calibration,
    relative_error,
    sampled_error,
    save_calibration,
)
from kamera_agent.window import KameraWindow

__all__ = [
    "CAPACITY",
    "FIT_SEEDS",
    "FLOOR_EVERY",
    "HELD_SEEDS",
    "calibrate",
    "drift_episode",
    "ensure_calibrated",
    "episodes",
]

FIT_SEEDS = (7001, 7002)
"""Episodes ``kamera calibrate`` fits on by default."""


HELD_SEEDS = (7101, 7102)
"""Episodes a calibration is judged on by default (disjoint from `FIT_SEEDS`)."""


CAPACITY = 12
"""The window an episode runs in (chunks)."""

FLOOR_EVERY = 4
"""The bf16 re-prefill (the model's own floor) runs after every this many ops, the first
included: the floor is a rate of the model's, which a sample of the ops measures (30 of the 120
a default calibration runs) at a quarter of the cost of measuring every op; where the hardware
has no bf16 arithmetic, each sample is `Floor`'s emulation, at about an fp32 re-prefill's cost."""


def drift_episode(
    model: Any,
    seed: int,
    ops: int,
    progress: Progress,
    share: float = 0.1,
    *,
    task: TaskID | None = None,
    texts: Sequence[Path] = (),
    **window: Any,
) -> list[Step]:
    """The window suite's episode (``seed``, ``ops``) with the policies unbounded; every op as a
    `Step`. ``model`` and ``window`` are what `KameraWindow` takes; a text model's frames are
    passages of the corpus's calibration half, or of ``texts``. ``task`` (else one of its own)
    advances once per op."""
    config = WindowConfig(
        capacity_chunks=CAPACITY, max_new_tokens=1, evicted_pixels="retain", drift_budget=None
    )
    window_ = KameraWindow(model, config=config, **window)
    backend = window_.backend
    if not isinstance(backend, TransformersBackend):
        raise TypeError("calibration runs on a transformers model (it needs the model's own re-prefill)")
    measurer = DriftBudget(0.0, Calibration(backend.fingerprint, scale=1.0, inherit=0.0, audit_share=share))
    moves = _Episode(window_, backend.encoder, random.Random(seed), _items(ops))
    query, start = QUERY, ""
    if backend.encoder.image_processor is None:  # a text model: passages of real text for frames
        moves.frames = text_frames(backend, seed, len(moves.frames), "calibration", texts)
        query, start = question(texts)
    asked = (window_.query_ids(query, answer_start=start), query, start)
    # the model's own noise, which the default ε must not exceed (emulated where bf16 is slow)
    floor = Floor(backend, torch.bfloat16, emulate=not native_bf16(backend.parts.device))
    reprefill = Truth(backend)  # the model's own, from the first chunk an op changed
    root = Context.root(backend.anchor.key)
    vision: dict[str, Any] = {}
    recorded: list[Step] = []
    task = progress.add_task(f"episode {seed}", total=ops) if task is None else task
    for index in range(ops):
        move = moves.next()
        move.run()
        refs = window_.refs
        chunks = [window_.chunk(ref) for ref in refs]
        sampled = floor if index % FLOOR_EVERY == 0 else None
        truth, answer, floor_agrees = _answers(window_, reprefill, sampled, chunks, asked)
        kvs = [window_.chunk_kv(ref) for ref in refs]
        starts = list(accumulate((chunk.advance for chunk in chunks), initial=backend.anchor.advance))
        measure = _measure(backend, chunks, [truth.kv[0], *kvs], starts, share, vision)
        states = [window_.state_of(ref) for ref in refs]
        owns = measurer.estimates(states, root, measure)
        ctx, slots, present = root, [], {state.chunk_key for state in states}
        for chunk, state, own, kv, exact in zip(chunks, states, owns, kvs, truth.kv[1:], strict=True):
            gone = absorbed_gone(state, present, ctx)
            ctx = ctx.extend(state)
            error = relative_error(kv, exact)
            slots.append(Slot(error, float(own or 0.0), ctx.exact, chunk.num_tokens, gone))
        agrees = int(answer.argmax()) == int(truth.logits.argmax())
        kl = next_token_kl(truth.logits, answer)
        recorded.append(Step(move.op, tuple(slots), kl, agrees, floor_agrees))
        progress.advance(task)
    window_.close()
    return recorded


def _answers(
    window: KameraWindow,
    reprefill: Truth,
    floor: Floor | None,
    chunks: list[Any],
    asked: tuple[torch.Tensor, str, str],
) -> tuple[Reference, torch.Tensor, bool | None]:
    """After an op: the model's own re-prefill, the window's first-token logits for the question
    (``asked``: its ids, it and the answer's opening), and whether the bf16 re-prefill kept the
    first token (``None``: not measured after this op)."""
    query_ids, query, start = asked
    truth = reprefill(chunks, query_ids)
    floor_agrees = None
    if floor is not None:
        floor.sync(chunks)
        floor_agrees = int(floor.first_logits(query_ids).argmax()) == int(truth.logits.argmax())
    answer = window.ask(query, decode=DecodeConfig(max_new_tokens=1), answer_start=start).first_logits
    return truth, answer.float().cpu(), floor_agrees


def _measure(
    backend: TransformersBackend,
    chunks: Sequence[Any],
    placed: Sequence[Any],
    starts: Sequence[int],
    share: float,
    vision: dict[str, Any],
) -> Measure:
    """The audit a budgeted window runs (`kamera_agent.fidelity.audit`: the same rows, over the
    same context), on one op's window: ``placed`` is the anchor's KV, then each chunk's."""

    def measure(i: int, state: ChunkState, ctx: Context) -> float:
        chunk = chunks[i]
        features = None
        if chunk.has_vision:
            assert chunk.vision_key is not None
            if chunk.vision_key not in vision:
                vision[chunk.vision_key] = backend.encode_vision(chunk).features
            features = vision[chunk.vision_key]
        indices = audit_indices(chunk.num_tokens, share, f"{state.digest}:{ctx.digest}")
        kv = placed[i + 1]
        audited = backend.recompute(chunk, kv, indices, placed[: i + 1], starts[i], features).kv[0]
        return sampled_error(kv, audited, indices)

    return measure


def episodes(
    model: Any,
    seeds: Sequence[int],
    ops: int,
    progress: Progress,
    share: float,
    *,
    texts: Sequence[Path] = (),
    **window: Any,
) -> list[Step]:
    """`drift_episode` for each seed, one after another, their ops together (one progress bar
    over all of them, with the time left)."""
    torch.manual_seed(0)
    task = progress.add_task("calibrating", total=len(seeds) * ops)
    out: list[Step] = []
    for n, seed in enumerate(seeds, start=1):
        progress.update(task, description=f"calibrating · episode {n} of {len(seeds)}")
        out += drift_episode(model, seed, ops, progress, share, task=task, texts=texts, **window)
    return out


def calibrate(
    model: Any,
    seeds: Sequence[int],
    ops: int,
    progress: Progress,
    share: float = 0.1,
    quantile: float = 0.99,
    *,
    texts: Sequence[Path] = (),
    **window: Any,
) -> tuple[Calibration, list[Step]]:
    """Fit a model's calibration on the episodes of ``seeds`` (`fit_calibration`); the calibration
    and its episodes. A text model reads passages of the corpus's calibration half, or of ``texts``."""
    fitted = episodes(model, seeds, ops, progress, share, texts=texts, **window)
    fingerprint = KameraWindow(model, config=WindowConfig(drift_budget=None), **window).backend.fingerprint
    return fit_calibration(fingerprint, fitted, seeds, share, quantile=quantile), fitted


def ensure_calibrated(backend: TransformersBackend, progress: Progress, ops: int = 40) -> Calibration:
    """The model's calibration, fitted now on `FIT_SEEDS` (text or image episodes as it reads) and
    filed in the user's calibration directory where it has none: a benchmark's random-weight
    shape is a model like any other, and its default budget needs one."""
    found = find_calibration(backend.fingerprint)
    if found is not None:
        return found
    calibration, _ = calibrate(backend, FIT_SEEDS, ops, progress)
    save_calibration(calibration)
    return calibration
