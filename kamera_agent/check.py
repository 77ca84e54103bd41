"""``kamera check MODEL_PATH``: the exactness checks to run before trusting reuse on a checkpoint.

Why: kamera-agent is exact only where the mathematics and the model agree (a known rotary
layout, a static RoPE scaling, a KV layout we read correctly). This runs, on the user's own
weights, the three checks the test suite runs on tiny models, against the model's own forward:

1. relocation: a chunk's stored canonical rotated to a far offset vs the model's keys there;
2. full-rank patch: canonical + exact patch, formed at one offset and applied at another, vs the
   model's conditioned KV there;
3. window vs generate: a window of chunks with exact patches answers with ``model.generate``'s
   greedy tokens on the same conversation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from rich.console import Console
from rich.table import Table

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.compat import last_logits_only
from kamera_agent.config import WindowConfig
from kamera_agent.core import KVCore
from kamera_agent.divergence import relative_error
from kamera_agent.loading import load_backend
from kamera_agent.operator.layout import to_position_free
from kamera_agent.operator.patch import apply_patch, form_patch
from kamera_agent.store import ChunkStore
from kamera_agent.window import KameraWindow

__all__ = ["CheckReport", "Verdict", "run_check"]


@dataclass(frozen=True)
class Verdict:
    """One check: what was compared, the measured figure, the bound, and whether it held."""

    name: str
    measured: float
    bound: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.measured <= self.bound


@dataclass
class CheckReport:
    """All verdicts for one checkpoint."""

    model: str
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)


def run_check(
    model: str | Path, console: Console | None = None, *, device: str | None = None, offset: int = 1000
) -> CheckReport:
    """Run the checks on a local checkpoint directory and print a verdict table."""
    console = console or Console()
    backend = load_backend(model, device=device)
    report = CheckReport(str(model))
    tolerance = 2e-5 if backend.parts.dtype == torch.float32 else 2e-2
    chunks = _probe_chunks(backend)
    report.verdicts.append(_relocation(backend, chunks[1], offset, tolerance))
    report.verdicts.append(_patch_transfer(backend, chunks, offset, tolerance))
    report.verdicts.append(_window_vs_generate(backend, chunks))
    _print(console, report, backend)
    return report


def _probe_chunks(backend: TransformersBackend) -> list[Chunk]:
    encoder = backend.encoder
    chunks = [
        encoder.text("The key is in the blue box. "),
        encoder.text("Alice moved the box to the attic. "),
    ]
    if encoder.image_processor is not None:
        rng = np.random.default_rng(0)
        picture = Image.fromarray(rng.integers(0, 255, (112, 84, 3), dtype=np.uint8))
        chunks.insert(1, encoder.image(picture, label="probe image"))
    return chunks


def _relocation(backend: TransformersBackend, chunk: Chunk, offset: int, tolerance: float) -> Verdict:
    (near,) = backend.prefill_sequence([chunk])
    (far,) = backend.prefill_sequence([chunk], shift=offset)
    moved = apply_patch(to_position_free(near, backend.layout), None, backend.layout, far.positions)  # type: ignore[arg-type]
    slot = backend.layout.rope_slot
    error = relative_error(moved.slot(slot), far.slot(slot))
    return Verdict(
        "relocation", error, tolerance, f"{chunk.kind} chunk moved by {offset} positions ({slot} band)"
    )


def _patch_transfer(
    backend: TransformersBackend, chunks: list[Chunk], offset: int, tolerance: float
) -> Verdict:
    here = backend.prefill_sequence(chunks)[-1]
    there = backend.prefill_sequence(chunks, shift=offset)[-1]
    core = KVCore(backend, ChunkStore(fingerprint=backend.fingerprint, memory_limit=1 << 30))
    canonical = core.canonical(chunks[-1], core.txn())
    patch = form_patch(canonical, here, backend.layout, "full")
    moved = apply_patch(canonical, patch, backend.layout, there.positions)  # type: ignore[arg-type]
    error = max(relative_error(moved.keys, there.keys), relative_error(moved.values, there.values))
    return Verdict(
        "full-rank patch", error, tolerance, f"formed at one offset, applied {offset} positions on"
    )


def _window_vs_generate(backend: TransformersBackend, chunks: list[Chunk]) -> Verdict:
    window = KameraWindow(backend, config=WindowConfig(rank="full", max_new_tokens=8))
    for chunk in chunks:
        window.push(chunk)
    question = "Where is the key?"
    inputs = window.as_model_inputs(question)
    with torch.no_grad():
        generated = backend.model.generate(**inputs, max_new_tokens=8, do_sample=False)
        reference = backend.model(**inputs, **last_logits_only(backend.model)).logits[0, -1].float()
    answer = window.ask(question, decode=DecodeConfig(max_new_tokens=8))
    expected = generated[0, inputs["input_ids"].shape[1] :].tolist()
    mismatch = 0.0 if expected[: len(answer.tokens)] == answer.tokens else 1.0
    gap = float((answer.first_logits.to(reference.device) - reference).abs().max())
    detail = f"greedy tokens {'equal' if not mismatch else 'differ'}; max logit difference {gap:.1e}"
    return Verdict("window vs generate", mismatch, 0.0, detail)


def _print(console: Console, report: CheckReport, backend: TransformersBackend) -> None:
    layout = backend.layout
    console.rule(f"[bold]kamera check[/bold] {report.model}")
    bases = " · a rotary base per layer" if layout.rope.per_layer else ""
    window = f" · sliding window {backend.sliding.window}" if backend.sliding is not None else ""
    console.print(
        f"family {layout.name} · {layout.kind.upper()} · {layout.num_layers} layers · rotary "
        f"{layout.rope.pairing}{' M-RoPE' if layout.rope.is_mrope else ''} ({layout.rope.rope_type}){bases}"
        f"{window} · {backend.parts.dtype}"
    )
    table = Table()
    for column in ("check", "measured", "bound", "verdict", "detail"):
        table.add_column(column)
    for v in report.verdicts:
        verdict = "[green]PASS[/green]" if v.passed else "[red]FAIL[/red]"
        table.add_row(v.name, f"{v.measured:.2e}", f"{v.bound:.0e}", verdict, v.detail)
    console.print(table)
    console.print("[green]all checks passed[/green]" if report.passed else "[red]some checks failed[/red]")
