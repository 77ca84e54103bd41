"""The demo episode (``kamera demo``): an agent's window over the shipped demo model.

Why this episode: it shows, on a real (tiny) VLM and offline, every window operation an agent
uses and what each costs against a prefix cache, and the one thing that makes reuse safe:
blind reuse answers the binding question wrong, the patched window answers it right.

Steps: push a legend (glyph → colour) and five captioned symbol frames; ask which colour most
frames mean (multi-hop) with the patched window and with blind reuse; shuffle the legend
(reorder); check which legend frame the question leans on (probe_without); let the oldest
symbol frames slide out, ask about one of them, recall it and ask again.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kamera_agent.config import WindowConfig
from kamera_agent.demo.model import load_demo_model
from kamera_agent.demo.task import QUESTIONS, make_item, render_legend, render_symbol
from kamera_agent.results import OpCost
from kamera_agent.window import ChunkRef, KameraWindow

__all__ = ["DemoStep", "EpisodeResult", "run_demo_episode"]


@dataclass(frozen=True)
class DemoStep:
    """One row of the episode: the op, its cost, and what a prefix cache would have prefilled."""

    op: str
    cost: OpCost
    prefix_cache_tokens: int
    note: str = ""


@dataclass
class EpisodeResult:
    """What the episode did and answered."""

    steps: list[DemoStep] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)
    expected: dict[str, str] = field(default_factory=dict)


def run_demo_episode(
    console: Console | None = None, model_path: str | Path | None = None, seed: int = 7
) -> EpisodeResult:
    """Run the episode on kamera-tiny-vl (or a checkpoint at ``model_path``) and print it."""
    console = console or Console()
    model, tokenizer, image_processor = load_demo_model(model_path)
    config = WindowConfig(rank="full", capacity_chunks=13, max_new_tokens=8)
    window = KameraWindow(model, tokenizer=tokenizer, image_processor=image_processor, config=config)
    item = make_item(random.Random(seed), "majority")
    result = EpisodeResult()

    def record(op: str, before: Sequence[ChunkRef], note: str = "") -> None:
        result.steps.append(DemoStep(op, window.stats.last, _prefix_cache_cost(window, before), note))

    legend = []
    for glyph, colour in item.legend:
        before = window.refs
        legend.append(window.push(render_legend(glyph, colour), label=f"legend {glyph}={colour}"))
        record("push legend", before, f"{glyph} means {colour}")
    symbols = []
    for k, glyph in enumerate(item.symbols, start=1):
        before = window.refs
        symbols.append(window.push(render_symbol(glyph), kind="frame", caption=f"#{k}", label=f"#{k}"))
        record("push frame", before, f"#{k} shows {glyph}")

    def ask(name: str, question: str, expected: str) -> None:
        before = window.refs
        answer = window.ask(question)
        result.answers[name], result.expected[name] = answer.text.strip(), expected
        record("ask", before, f"{question} → {answer.text.strip()!r} (expected {expected!r})")

    ask("majority", item.question, item.answer)
    blind = KameraWindow(window.backend, config=config.model_copy(update={"patch_mode": "none"}))
    for ref in window.refs:
        blind.push(window.chunk(ref))
    result.answers["majority (blind reuse)"] = blind.ask(item.question).text.strip()
    result.expected["majority (blind reuse)"] = item.answer

    before = window.refs
    shuffled = random.Random(seed).sample(legend, len(legend))
    window.reorder([*shuffled, *symbols])
    record("reorder legend", before, "legend shuffled: patches from the store or formed once")
    ask("majority after reorder", item.question, item.answer)

    used = {glyph for glyph in item.symbols}
    idle = next(ref for ref, (glyph, _) in zip(legend, item.legend, strict=True) if glyph not in used)
    probe = window.probe_without(idle, item.question)
    result.steps.append(
        DemoStep(
            "probe_without", probe.cost, 0, f"{idle.label}: KL {probe.kl:.2e}, disposable={probe.disposable}"
        )
    )

    before = window.refs
    window.evict(symbols[0])
    record("evict #1", before, "canonical stays in the store")
    before = window.refs
    window.recall(symbols[0], at=len(legend))
    record("recall #1", before, "no vision encode; its stored patch")
    colour_question = QUESTIONS["colour"].format(k=1)
    ask("colour of #1", colour_question, item.meaning[item.symbols[0]])
    _print(console, result, window)
    return result


def _prefix_cache_cost(window: KameraWindow, before: Sequence[ChunkRef]) -> int:
    """Tokens a prefix cache re-prefills: everything from the first slot whose chunk changed."""
    after = window.refs
    same = 0
    while same < min(len(before), len(after)) and before[same] == after[same]:
        same += 1
    return sum(window.chunk(ref).num_tokens for ref in after[same:])


def _print(console: Console, result: EpisodeResult, window: KameraWindow) -> None:
    console.rule("[bold]kamera-agent demo[/bold] · kamera-tiny-vl (Qwen2-VL class, offline)")
    table = Table(show_lines=False)
    table.add_column("op", no_wrap=True)
    for column in ("fwd", "prefilled", "reused", "prefix cache"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("note", overflow="fold")
    for step in result.steps:
        table.add_row(
            step.op,
            str(step.cost.forwards),
            str(step.cost.tokens_prefilled),
            str(step.cost.tokens_reused),
            str(step.prefix_cache_tokens),
            step.note,
        )
    console.print(table)
    answers = Table(title="Answers")
    for column in ("question", "answer", "expected", "right?"):
        answers.add_column(column)
    for name, answer in result.answers.items():
        expected = result.expected[name]
        answers.add_row(name, answer, expected, "✓" if answer.startswith(expected) else "✗")
    console.print(answers)
    total = window.stats.total
    console.print(
        f"window total: {total.forwards} forwards, {total.tokens_prefilled} tokens prefilled, "
        f"{total.tokens_reused} tokens reused from the store, {total.seconds:.2f} s"
    )
