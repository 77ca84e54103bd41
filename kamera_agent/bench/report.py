"""Tables of a bench run, built once and rendered twice: rich on screen, markdown in report.md.

Why one table model: the screen and the file must never disagree, so each suite's figures go
through one `Grid` (title, columns, rows of formatted cells, a note) and two small renderers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kamera_agent.bench.agents.report import agent_grids
from kamera_agent.bench.cost import CostRun
from kamera_agent.bench.fidelity import FidelityRun
from kamera_agent.bench.frontier import FrontierRun
from kamera_agent.bench.results import BenchResults, targets
from kamera_agent.bench.tables import Grid
from kamera_agent.bench.window_suite import PREFIX, RECOMPUTE
from kamera_agent.demo.task import SPARSE_GLYPHS

__all__ = ["Grid", "grids", "print_report", "write_markdown"]


def _pct(value: float) -> str:
    return "–" if value != value else f"{value:.1%}"  # NaN reads as "–"


def _sci(value: float) -> str:
    return "–" if value != value else f"{value:.2e}"


Column = tuple[str, Callable[[Any], str]]

_FIDELITY: tuple[Column, ...] = (
    ("arm", lambda f: f.arm),
    ("acc", lambda f: _pct(f.accuracy)),
    ("multi-hop", lambda f: _pct(f.multi_hop_accuracy)),
    ("95 % interval", lambda f: f"{_pct(f.binding_ci[0])}–{_pct(f.binding_ci[1])}"),
    ("glyph", lambda f: _pct(f.glyph_accuracy)),
    ("KL", lambda f: _sci(f.kl)),
    ("η", lambda f: f"{f.eta:.4f}"),
    ("η m-hop", lambda f: f"{f.eta_multi_hop:.4f}"),
    ("top-1", lambda f: _pct(f.top1_agreement)),
    ("flips", lambda f: _pct(f.flip_recovery)),
    ("stored", lambda f: _pct(f.spend.stored)),
    ("recomp.", lambda f: _pct(f.spend.recomputed)),
)
_TTFT: tuple[Column, ...] = (
    ("tokens", lambda r: str(r.tokens)),
    ("re-prefill ms", lambda r: f"{r.reprefill_ms:.1f}"),
    ("reuse ms", lambda r: f"{r.reuse_ms:.2f}"),
    ("speed-up", lambda r: f"{r.ratio:.0f}x"),
    ("restore ms", lambda r: f"{r.restore_ms:.2f}"),
    ("query ms", lambda r: f"{r.query_ms:.1f}"),
    ("SVD ms", lambda r: f"{r.form_ms[r.reuse_rank]:.1f}"),
    ("break-even", lambda r: f"{r.break_even:.3f}"),
    ("exact Δlogit", lambda r: _sci(r.full_rank_logit_error)),
)


def _grid(title: str, columns: Sequence[Column], items: Sequence[Any], note: str = "") -> Grid:
    rows = tuple(tuple(fmt(item) for _, fmt in columns) for item in items)
    return Grid(title, tuple(name for name, _ in columns), rows, note)


def fidelity_grid(run: FidelityRun) -> Grid:
    tokens = sorted(set(run.chunk_tokens))
    note = (
        f"{run.items_done}/{run.items_requested} held-out items (seed {run.seed}), model {run.model}, "
        f"{run.seconds:.0f} s. acc: all items; multi-hop: the colour no page shows (binding); glyph: "
        "the glyph the legend draws in red (one-token readout). KL: next-token KL to re-prefill; "
        "η: share of the blind→re-prefill KL gap closed; "
        "top-1: agreement with re-prefill; flips: items where blind reuse changes the top token that "
        "the arm answers as re-prefill; stored: patch bytes / chunk KV bytes; recomp.: tokens "
        f"recomputed in context. Chunks of {tokens} tokens: rank >= {max(tokens, default=0)} is full rank. "
        "Intervals: 95 % bootstrap over items. Token-recompute arms get their selected tokens' true "
        "in-context KV (an upper bound of the method). " + _deficit_note(run)
    )
    return _grid("Fidelity: every arm on the same items", _FIDELITY, run.figures(), note)


def _deficit_note(run: FidelityRun) -> str:
    deficit = run.to_json()["deficit"]
    relative = ", ".join(f"{r:.2f}" for r in deficit["relative_by_layer"])
    return (
        f"Pages' deficit Δ = KV(page|legend) − KV(page|∅): relative size by layer {relative}; energy "
        f"deeper half / shallower half {deficit['deep_over_shallow_energy'] or float('nan'):.2f}; "
        "90 %-energy rank median "
        f"{deficit['rank90_median']} (range {deficit['rank90_range'][0]}–{deficit['rank90_range'][1]}); "
        f"under another legend order Δ moves by {deficit['order_change_median']:.2f} of its size (median)."
    )


def control_grid(run: FidelityRun) -> Grid:
    rows = tuple((arm, f"{accuracy:.1%}", f"{eta:.3f}") for arm, accuracy, eta in run.control_figures())
    note = (
        f"{run.control_items_done} held-out binding items whose pages hold {SPARSE_GLYPHS} glyphs each "
        "(the rest filler): only a few tokens bind, so recomputing the few that deviate most should "
        "repair the page. η: share of the blind→re-prefill KL gap closed on these items."
    )
    title = "Sparse-binding control: token recompute where binding is sparse"
    return Grid(title, CONTROL_COLUMNS, rows, note)


CONTROL_COLUMNS = ("arm", "binding acc", "η")


def cost_grids(run: CostRun) -> list[Grid]:
    s = run.shape
    note = (
        f"Qwen2 slice: {s.layers} layers, hidden {s.hidden}, {s.heads}/{s.kv_heads} heads, head_dim "
        f"{s.head_dim}, MLP {s.mlp}; random init, float32, {run.threads} thread(s). TTFT of a "
        f"{s.query}-token query behind anchor {s.anchor} + antecedent {s.antecedent} + chunk; median of "
        f"{s.repeats} (re-prefill) / {s.repeats * 3} (reuse) runs; rank-{s.reuse_rank} patch. "
        "Reuse = restore (relocate + patch + assemble) + the query's own prefill, which re-prefill "
        "pays too: the speed-up is bounded by (context + query) / query tokens. "
        "Break-even: reuses that pay for the SVD (the conditioned forward is the admission's own). "
        "Exact Δlogit: reuse with a full-rank patch vs re-prefill."
    )
    bytes_columns: tuple[Column, ...] = (
        ("tokens", lambda r: str(r.tokens)),
        ("chunk KV MiB", lambda r: f"{r.kv_bytes / 2**20:.2f}"),
        *((f"rank-{m}", lambda r, m=m: _pct(r.patch_bytes[m] / r.kv_bytes)) for m in s.ranks),
        ("SVD ms by rank", lambda r: " / ".join(f"{r.form_ms[m]:.1f}" for m in s.ranks)),
    )
    return [
        _grid("Cost: time to first token after reuse vs re-prefill", _TTFT, run.rows, note),
        _grid("Cost: patch bytes (share of the chunk's KV) and forming time", bytes_columns, run.rows),
    ]


def _ratio(value: float) -> str:
    return "–" if value != value else f"{value:.2f}×"


_FRONTIER: tuple[Column, ...] = (
    ("row", lambda f: f.row),
    ("KL mean", lambda f: _sci(f.kl_mean)),
    ("KL p90", lambda f: _sci(f.kl_p90)),
    ("KL max", lambda f: _sci(f.kl_max)),
    ("top-1", lambda f: _pct(f.agreement)),
    ("tokens", lambda f: f"{f.tokens:,.0f}"),
    ("fwd", lambda f: f"{f.forwards:,.0f}"),
    ("wall s", lambda f: f"{f.ms / 1e3:.2f}"),
    ("prefix s", lambda f: f"{f.prefix_ms / 1e3:.2f}"),
    ("wall / prefix", lambda f: _ratio(f.wall_ratio)),
    ("+ asks", lambda f: _ratio(f.wall_ratio_with_asks)),
)


def frontier_grid(run: FrontierRun) -> Grid:
    """The frontier: every row's fidelity after every op beside what it spent."""
    figures = run.figures()
    ops = max((f.ops for f in figures[1:]), default=0)
    settings = "; ".join(f"{f.row}: {f.changed}" for f in figures[1:] if f.row not in RECOMPUTE)
    swept = [f for f in figures if f.row in RECOMPUTE]
    if swept:
        settings += (
            f"; recompute N%: token recompute (CacheBlend-style: each content prefilled once over the "
            f"anchor and reused at its slot, the unchanged prefix kept, N % of every later chunk's "
            f"tokens recomputed over what precedes it, chosen by a one-layer deviation probe whose "
            f"cost is counted), {swept[0].changed}"
        )
    note = (
        f"{len(run.runs)} runs of one {run.ops_requested}-op episode (seed {run.seed}; {ops} ops done "
        f"per row), capacity {run.capacity} chunks, push / slide / reorder / recall over "
        f"{run.content}, {run.seconds:.0f} s. After every op, outside every clock, "
        "each side's first answer token to one question is compared with the model's own re-prefill "
        "of the window's sequence: KL = next-token KL(re-prefill ‖ side), mean / 90th percentile / "
        "max over the ops; top-1 = share of ops whose first token agrees. tokens, fwd: prefilled "
        "tokens and forwards over the episode (a lazy window's deferred patches formed right after "
        "each op, inside its clock, and counted as the op's). wall s: the side's ops; prefix s: the "
        "prefix cache's syncs in the same run, beside it; wall / prefix: their ratio (< 1: faster "
        "than the prefix cache); + asks: the same with each op's question added on both sides "
        "(kamera: placing what changed and the query's forward; the prefix cache: the query's "
        f"forward). The {PREFIX} row pools its KL over every run (its tokens are the same in each), "
        f"its wall from the first. Settings (what differs from WindowConfig()): {settings}."
    )
    title = "Window frontier: one episode under every setting, measured after every op"
    return _grid(title, _FRONTIER, figures, note)


def targets_grid(results: BenchResults) -> Grid:
    verdict = {True: "met", False: "NOT met", None: "–"}
    rows = tuple((t.claim, t.measured, verdict[t.met]) for t in targets(results))
    return Grid("Targets", ("target", "measured", "met?"), rows)


def grids(results: BenchResults) -> list[Grid]:
    """Every table the run has figures for, suites first, targets last."""
    fidelity = results.fidelity
    tables = [fidelity_grid(fidelity)] if fidelity is not None else []
    tables += [control_grid(fidelity)] if fidelity is not None and fidelity.control_items_done else []
    tables += cost_grids(results.cost) if results.cost is not None else []
    tables += [frontier_grid(results.window)] if results.window is not None and results.window.runs else []
    tables += agent_grids(results.agents) if results.agents is not None else []
    return [*tables, targets_grid(results)]


def print_report(console: Console, tables: Sequence[Grid]) -> None:
    for grid in tables:
        table = Table(title=grid.title, caption=grid.note or None, caption_justify="left")
        names = max((len(row[0]) for row in grid.rows), default=0) <= 16  # short row names stay whole
        for index, column in enumerate(grid.columns):
            first = index == 0
            table.add_column(column, justify="left" if first else "right", no_wrap=first and names)
        for row in grid.rows:
            table.add_row(*row)
        console.print(table)


def write_markdown(path: Path, results: BenchResults, tables: Sequence[Grid]) -> None:
    machine = results.machine
    lines = [
        "# kamera bench",
        "",
        f"{'**Partial run** (interrupted in ' + str(results.interrupted) + '). ' if results.partial else ''}"
        f"{machine['platform']} · {machine['processor']} · {machine['cpu_count']} CPUs · torch "
        f"{machine['torch']} · transformers {machine['transformers']} · {machine['torch_threads']} "
        f"thread(s) · {results.seconds:.0f} s",
        "",
    ]
    for grid in tables:
        lines += [f"## {grid.title}", "", "| " + " | ".join(grid.columns) + " |"]
        lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(grid.columns))) + "|")
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in grid.rows]
        lines += ["", grid.note, ""] if grid.note else [""]
    path.write_text("\n".join(lines))
