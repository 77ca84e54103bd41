"""Running the agents: every script on every side, step by step, timed side by side.

On a real text model (`run_text_suite`) the agents run on that model alone, over real text
and accessibility-tree screens at agents' lengths, every step checked against its re-prefill.

Why one loop for all sides: the ratios are only meaningful when both sides of a comparison see
the same machine state, so each step runs on the kamera window (defaults), the kamera window
(`WindowConfig.exact`) and the prefix cache one after the other, the order rotating from step
to step, all over one model in one process. Checks (answer agreement, KL, the baseline against
the model's own re-prefill) run after every step, outside every clock: a step that asks is
checked on its answer; after one that asks none, each side answers the last question asked (the
script's first before any) outside its clock, kamera from a fork of its window and the prefix
cache cropping the question off again, so what the next step costs is what it would have been.
"""

from __future__ import annotations

import cProfile
import gc
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from rich.progress import Progress

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.agents.contents import Contents, DemoContents, RandomContents
from kamera_agent.bench.agents.records import (
    PREFIX,
    RECOMPUTE_SIDES,
    TEXT_SIDES,
    UNBOUNDED,
    AgentRun,
    AgentsRun,
    AskRecord,
    StepRecord,
)
from kamera_agent.bench.agents.script import Question, Script, Step
from kamera_agent.bench.agents.scripts import AGENTS, QUICK_TOKENS, REALISTIC_TOKENS, AgentCounts
from kamera_agent.bench.agents.sides import KameraSide, Outcome, PrefixSide, RecomputeSide, answer_logits
from kamera_agent.bench.agents.text_contents import QUICK_TEXT_LENGTHS, TEXT_LENGTHS, TextContents
from kamera_agent.bench.agents.ttft import TTFTShape, run_ttft
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.config import WindowConfig
from kamera_agent.divergence import next_token_kl
from kamera_agent.errors import SettingsError
from kamera_agent.models.random_qwen2 import QWEN2_1_5B_SLICE, Qwen2Shape, random_qwen2

__all__ = [
    "QUICK_SHAPE",
    "new_run",
    "realistic_backend",
    "run_agent",
    "run_suite",
    "run_text_suite",
    "side_configs",
    "warm",
]

QUICK_SHAPE = Qwen2Shape(layers=2, hidden=64, heads=4, kv_heads=2, mlp=128, vocab=1024)
"""The realistic model's stand-in for smoke runs: the same architecture at toy widths."""
Side = KameraSide | PrefixSide | RecomputeSide


def new_run(quick: bool, agents: Sequence[str], demo_model: str, *, text: bool = False) -> AgentsRun:
    """The suite's record, sized for a full or a quick run (set up before anything runs); with
    ``text``, for a real text model (`run_text_suite`)."""
    if text:
        return AgentsRun(
            quick=quick,
            threads=torch.get_num_threads(),
            shape=None,
            demo_model=demo_model,
            counts=AgentCounts.quick() if quick else AgentCounts.text(),
            tokens={},
            agents=tuple(agents),
            text_lengths=QUICK_TEXT_LENGTHS if quick else TEXT_LENGTHS,
            content=(
                "real text: tool outputs and pages from the benchmark half of kamera's corpus, screens as "
                "accessibility trees, short transcript lines, questions whose answer opening makes "
                "the first token name what was read (`TEXT_QUESTIONS`)"
            ),
        )
    return AgentsRun(
        quick=quick,
        threads=torch.get_num_threads(),
        shape=QUICK_SHAPE if quick else QWEN2_1_5B_SLICE,
        demo_model=demo_model,
        counts=AgentCounts.quick() if quick else AgentCounts(),
        tokens=QUICK_TOKENS if quick else REALISTIC_TOKENS,
        agents=tuple(agents),
    )


def realistic_backend(shape: Qwen2Shape, seed: int) -> TransformersBackend:
    """A random-init Qwen2 of ``shape`` (float32) behind the transformers backend."""
    from kamera_agent.models.tiny_tokenizer import build_byte_tokenizer

    model = random_qwen2(shape, seed=seed, max_positions=32768)
    return TransformersBackend(model, tokenizer=build_byte_tokenizer(vocab_size=shape.vocab))


def side_configs(capacity: int | None) -> dict[str, WindowConfig]:
    """The kamera sides' settings: the defaults, the exact ones, and the defaults' policies with
    no drift budget (one token answers)."""
    return {
        "kamera": WindowConfig(capacity_chunks=capacity, max_new_tokens=1),
        "kamera-exact": WindowConfig.exact(capacity_chunks=capacity, max_new_tokens=1),
        UNBOUNDED: WindowConfig(capacity_chunks=capacity, max_new_tokens=1, drift_budget=None),
    }


def run_suite(run: AgentsRun, demo_parts: tuple[Any, Any, Any], seed: int, progress: Progress) -> None:
    """Every agent of ``run`` on the demo model, then on the realistic shape; then time to first
    token after window ops on the realistic shape.

    Mutates: ``run.runs`` (an `AgentRun` per agent × model, appended as each starts), ``run.ttft``.
    """
    model, tokenizer, image_processor = demo_parts
    assert run.shape is not None, "the vision path runs the realistic shape beside the demo model"
    demo = TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)
    realistic = realistic_backend(run.shape, seed)
    if not run.quick:  # its defaults keep a drift budget: calibrated once per shape and seed
        from kamera_agent.bench.calibration_episodes import ensure_calibrated

        ensure_calibrated(realistic, progress)
    backends = {"demo": demo, "realistic": realistic}
    contents: dict[str, Contents] = {
        "demo": DemoContents(demo.encoder, seed),
        "realistic": RandomContents(realistic.encoder, run.tokens, run.shape.vocab, seed),
    }
    for backend in backends.values():
        warm(backend)
    for agent in run.agents:
        for name, backend in backends.items():
            script = AGENTS[agent](contents[name], run.counts)
            record = AgentRun.of(script, name)
            run.runs.append(record)
            run_agent(script, backend, record, progress, reference="re-prefill" if name == "demo" else PREFIX)
    shape = TTFTShape.quick() if run.quick else TTFTShape()
    run.ttft = run_ttft(realistic, shape, seed, progress)


def run_text_suite(run: AgentsRun, backend: TransformersBackend, seed: int, progress: Progress) -> None:
    """Every agent of ``run`` on a real text model, with text at agents' lengths
    (`TextContents`), each side checked against the model's own re-prefill after every step.

    Mutates: ``run.runs`` (an `AgentRun` per agent, appended as each starts).

    Raises:
        SettingsError: a script's window would pass the model's context (before any step runs).
    """
    assert run.text_lengths is not None, "a text run has its lengths (new_run(..., text=True))"
    contents = TextContents(backend.encoder, run.text_lengths, seed)
    warm(backend)
    for agent in run.agents:
        script = AGENTS[agent](contents, run.counts)
        _fits(script, backend)
        record = AgentRun.of(script, run.demo_model, sides=TEXT_SIDES)
        run.runs.append(record)
        run_agent(script, backend, record, progress, reference="re-prefill")


def _fits(script: Script, backend: TransformersBackend) -> None:
    limit = backend.context_limit
    if limit is None:
        return
    longest = max(sum(script.chunks[label].num_tokens for label in step.lineup) for step in script.steps)
    query = max(len((step.ask or Question("")).ids(backend.encoder)) for step in script.steps)
    needed = backend.anchor.num_tokens + longest + query
    if needed > limit:
        raise SettingsError(
            f"the {script.agent} agent's window reaches {needed} tokens with its question, past the "
            f"model's context of {limit}: run it with --quick, or on a model with a longer context"
        )


def run_agent(
    script: Script,
    backend: TransformersBackend,
    record: AgentRun,
    progress: Progress,
    *,
    reference: str,
    profiler: cProfile.Profile | None = None,
    configs: Mapping[str, WindowConfig] | None = None,
) -> None:
    """Run ``script`` on every side of ``record``, then check the final window.

    Args:
        reference: what each answer is compared with: ``"re-prefill"`` (the model's own forward
            over the window, per question) or ``"prefix"`` (the prefix cache's own logits).
        profiler: profiles the default kamera side's steps only (``kamera_agent.bench.agents.profile``).
        configs: each kamera side's settings, by side name (default: `side_configs`).

    Mutates: ``record`` (a record per step, a check per question, the final checks).

    Raises:
        RuntimeError: a window's lineup differs from the script's after a step.
    """
    began = time.perf_counter()
    configs = configs if configs is not None else side_configs(script.capacity)
    sides = _sides(script, backend, record, configs)
    names = list(record.sides)
    task = progress.add_task(
        f"agents · {script.agent} on {record.model} · {len(names)} sides", total=len(script.steps)
    )
    last_query = next((step.ask for step in script.steps if step.ask is not None), None)
    for index, step in enumerate(script.steps):
        shift = index % len(names)
        outcomes = {
            name: _timed(sides[name], step, profiler if name == "kamera" else None)
            for name in names[shift:] + names[:shift]
        }
        _check_lineups(sides, step)
        chunks = [script.chunks[label] for label in step.lineup]
        record.records.append(_step_record(index, step, chunks, outcomes, names))
        query = step.ask or last_query
        if query is not None:
            logits = _answers(sides, outcomes, step, query)
            checked = _check(index, query, chunks, backend, logits, reference, step.ask is not None)
            if checked is not None:
                record.checks.append(checked)
            last_query = query
        progress.advance(task)
    _final_checks(script, backend, sides, record)
    record.seconds = time.perf_counter() - began
    del sides
    gc.collect()


def _sides(
    script: Script, backend: TransformersBackend, record: AgentRun, configs: Mapping[str, WindowConfig]
) -> dict[str, Side]:
    """Every side ``record`` names, built over the script's chunks, with its settings recorded."""
    sides: dict[str, Side] = {}
    for name in record.sides:
        if name == PREFIX:
            sides[name] = PrefixSide(backend, script.chunks)
            record.settings[name] = {"cache_vision": True, "syncs": "once per step, before its question"}
        elif name in RECOMPUTE_SIDES:
            sides[name] = RecomputeSide(backend, script.chunks, RECOMPUTE_SIDES[name])
            record.settings[name] = {"fraction": RECOMPUTE_SIDES[name], "selection": "one-layer deviation"}
        else:
            sides[name] = KameraSide(backend, configs[name], script.chunks)
            record.settings[name] = configs[name].model_dump(mode="json")
    return sides


def _step_record(
    index: int, step: Step, chunks: Sequence[Chunk], outcomes: Mapping[str, Outcome], names: Sequence[str]
) -> StepRecord:
    """The record of one step: its lineup's size and every side's cost and ops, in ``names``' order."""
    tokens = sum(chunk.num_tokens for chunk in chunks)
    costs = {name: outcomes[name].cost for name in names}
    ops = {name: outcomes[name].ops for name in names}
    return StepRecord(index, step.kind, step.detail, len(chunks), tokens, step.ask is not None, costs, ops)


def _timed(side: Side, step: Step, profiler: cProfile.Profile | None) -> Outcome:
    if profiler is None:
        return side.run(step)
    profiler.enable()
    try:
        return side.run(step)
    finally:
        profiler.disable()


def _check_lineups(sides: Mapping[str, Side], step: Step) -> None:
    for name, side in sides.items():
        if isinstance(side, KameraSide) and side.lineup() != step.lineup:
            raise RuntimeError(
                f"{name} holds {list(side.lineup())} after {step.kind} ({step.detail}); the script "
                f"expects {list(step.lineup)}"
            )


def _answers(
    sides: Mapping[str, Side], outcomes: Mapping[str, Outcome], step: Step, query: Question
) -> dict[str, torch.Tensor]:
    """Every side's first-token logits for ``query`` after the step: its timed answer where the
    step asked, else an untimed one (`KameraSide.measure`, `PrefixSide.measure`)."""
    out = {}
    for name, side in sides.items():
        answered = outcomes[name].logits if step.ask is not None else None
        if answered is None:
            answered = (
                side.measure(query) if isinstance(side, KameraSide) else side.measure(query, step.lineup)
            )
        out[name] = answered
    return out


def _check(
    index: int,
    query: Question,
    chunks: Sequence[Any],
    backend: TransformersBackend,
    logits: Mapping[str, torch.Tensor],
    reference: str,
    asked: bool,
) -> AskRecord | None:
    """Each kamera side's first token and next-token KL against the reference's (``None``: the
    reference is the prefix cache and it did not run)."""
    prefix = logits.get(PREFIX)
    error = math.nan
    if reference == "re-prefill":
        truth = backend.reference_prefill(chunks, query.ids(backend.encoder)).logits
        if prefix is not None:
            error = float((prefix - truth).abs().max())
    elif prefix is not None:
        truth = prefix
    else:
        return None
    answers = {name: value for name, value in logits.items() if name != PREFIX}
    top1 = {name: int(value.argmax()) == int(truth.argmax()) for name, value in answers.items()}
    kl = {name: next_token_kl(truth, value) for name, value in answers.items()}
    return AskRecord(index, query.text + query.answer_start, reference, top1, kl, error, asked)


def _final_checks(
    script: Script, backend: TransformersBackend, sides: Mapping[str, Side], record: AgentRun
) -> None:
    """Every side's next-token logits over the final window against the model's own re-prefill."""
    query = next((step.ask for step in reversed(script.steps) if step.ask is not None), None)
    if query is None or not script.steps:
        return
    chunks = [script.chunks[label] for label in script.steps[-1].lineup]
    query_ids = query.ids(backend.encoder)
    truth = backend.reference_prefill(chunks, query_ids).logits
    for name, side in sides.items():
        if isinstance(side, PrefixSide):
            side.cache.sync(chunks)  # crops the last question off; nothing to prefill
            record.baseline_logit_error = float((side.cache.ask(query_ids).logits - truth).abs().max())
        elif isinstance(side, RecomputeSide):
            record.final_kl[name] = next_token_kl(truth, side.measure(query, script.steps[-1].lineup))
        else:
            record.final_kl[name] = next_token_kl(truth, answer_logits(side.window, query))


def warm(backend: TransformersBackend) -> None:
    """Two untimed forwards: the first calls of a process pay allocator and kernel set-up."""
    anchor = backend.anchor
    for _ in range(2):
        backend.forward_tokens(anchor.input_ids, anchor.positions_at(0), backend.assemble([]))
