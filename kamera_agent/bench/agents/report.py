"""The agents suite's tables and its claims, from its records (nothing typed in by hand).

Why ratios beside totals: a ratio alone hides whether a side won by doing less work or by
doing it faster, so each table puts wall time, tokens prefilled, forwards and vision-tower runs
next to each other for every side, then the prefix cache's figure over the side's (higher:
the side spent less). The claims are judged on the realistic shape at kamera's defaults; the
exact settings are reported beside them.
"""

from __future__ import annotations

import math

from kamera_agent.bench.agents.records import PREFIX, SIDES, AgentRun, AgentsRun
from kamera_agent.bench.tables import Grid, Target

__all__ = ["agent_grids", "agent_targets", "kind_grid", "ttft_grid"]

_OPS = ("push", "extend", "replace", "evict", "reorder", "recall", "arrange", "sync", "ask")


def _times(value: float) -> str:
    return "–" if not math.isfinite(value) else f"{value:.2f}×"


def _pct(value: float) -> str:
    return "–" if not math.isfinite(value) else f"{value:.1%}"


def _sci(value: float) -> str:
    return "–" if not math.isfinite(value) else f"{value:.1e}"


def _side_row(run: AgentRun, side: str) -> tuple[str, ...]:
    totals = [f"{run.total(side, name):.0f}" for name in ("ms", "tokens", "forwards", "vision")]
    if side == PREFIX:
        return (run.model, side, *totals, "1×", "1×", "1×", "–", "–", "–", "–")
    ratios = [_times(run.ratio(name, side)) for name in ("ms", "tokens", "forwards")]
    mean, high, worst = run.kl(side)
    kl = (_sci(mean), _sci(high), _sci(worst))
    return (run.model, side, *totals, *ratios, _pct(run.agreement(side)), *kl)


def agent_grid(suite: AgentsRun, agent: str) -> Grid | None:
    """One agent on every model and side: totals, prefix/side ratios, answer fidelity."""
    runs = suite.of_agent(agent)
    if not runs:
        return None
    columns: tuple[str, ...] = ("model", "side", "ms", "tokens", "fwd", "vision")
    columns += ("ms ×", "tok ×", "fwd ×", "top-1", "KL mean", "KL p90", "KL max")
    rows = tuple(_side_row(run, side) for run in runs for side in run.sides)
    notes = []
    for run in runs:
        sizes = ", ".join(f"{kind} {tokens}" for kind, tokens in run.sizes.items())
        reference = (
            "the model's own re-prefill"
            if run.model != "realistic"
            else "the prefix cache's logits; random weights leave small top-1 margins, read KL"
        )
        final = ", ".join(f"{side} {_sci(kl)}" for side, kl in run.final_kl.items())
        notes.append(
            f"{run.model}: {len(run.records)}/{run.steps_requested} steps, {len(run.asks)} questions, "
            f"{len(run.checks)} checks (vs {reference}), tokens per chunk: {sizes}; "
            "prefix cache vs the model's own re-prefill: "
            f"max |Δlogit| {_sci(run.max_baseline_error())}; final-window KL: {final or '–'}; "
            f"{run.seconds:.0f} s."
        )
    first = runs[0]
    capacity = "unbounded" if first.capacity is None else f"capacity {first.capacity} chunks"
    note = (
        f"{first.summary}; {capacity}. ms: wall milliseconds; tok: tokens prefilled; fwd: forwards; "
        "vision: vision-tower runs; × = the prefix cache's total over the side's (higher: the side "
        "spent less). Checked after every step, outside every clock: top-1 = share of steps after "
        "which the side's first answer token agrees with the reference; KL = next-token KL to it, "
        "mean / 90th percentile / max over the steps (a step that asks none is checked on the last "
        "question asked). Wall time includes every question the script asks. " + " ".join(notes)
    )
    return Grid(f"Agent {agent}: kamera (defaults, exact) vs the prefix cache", columns, rows, note)


def time_grid(suite: AgentsRun) -> Grid | None:
    """Where each side's wall time goes on the realistic shape (or the real text model), by op kind."""
    rows = []
    for run in suite.runs:
        if run.model == "demo":
            continue
        agent = run.agent
        for side in run.sides:
            spent = run.op_ms(side)
            cells = [f"{spent[op]:.0f}" if op in spent else "–" for op in _OPS]
            rows.append((agent, side, *cells, f"{run.total(side, 'ms'):.0f}"))
    if not rows:
        return None
    note = (
        "Milliseconds per op kind, summed over the run. kamera: its window ops (a web step's replace "
        "includes the line and screenshot it appends; a step of several ops, e.g. a reader's evict "
        "and push, is one arrange, as one request) and questions; the prefix cache: one sync per "
        "step (crop at the first change, prefill the rest) and its questions."
    )
    where = "realistic shape" if suite.shape is not None else suite.demo_model
    return Grid(f"Agents: wall time by op ({where})", ("agent", "side", *_OPS, "total"), tuple(rows), note)


def kind_grid(suite: AgentsRun) -> Grid | None:
    """Per agent and step kind: each side's tokens and wall time, each kamera side's first-token
    agreement and mean KL against the reference after steps of that kind."""
    rows = []
    for run in suite.runs:
        kinds = {side: run.by_kind(side) for side in run.sides}
        for kind, prefix in kinds[PREFIX].items():
            cells = [run.model, run.agent, kind, str(prefix["steps"]), f"{prefix['tokens']:,}"]
            for side in run.sides:
                if side == PREFIX:
                    continue
                entry = kinds[side][kind]
                agree, kl = entry["agreement"], entry["kl_mean"]
                cells += [
                    f"{entry['tokens']:,}",
                    "–" if agree is None else f"{agree:.0%}",
                    "–" if kl is None else f"{kl:.1e}",
                ]
            rows.append(tuple(cells))
    if not rows:
        return None
    kamera = [side for side in SIDES if side != PREFIX]
    columns: tuple[str, ...] = ("model", "agent", "step kind", "steps", "prefix tok")
    for side in kamera:
        columns += (f"{side} tok", f"{side} top-1", f"{side} KL")
    note = (
        "Tokens prefilled by each side over the steps of each kind, and each kamera side's first-token "
        "agreement and mean next-token KL against the reference after them (checked after every step)."
    )
    return Grid("Agents: by step kind", columns, tuple(rows), note)


def ttft_grid(suite: AgentsRun) -> Grid | None:
    """Time to first token after each op against its floor (the query's forward alone)."""
    run = suite.ttft
    if run is None or not run.rows:
        return None
    rows = tuple(
        (
            row.op,
            f"{row.placed}",
            f"{row.op_ms:.0f}",
            f"{row.ttft_ms:.0f}",
            f"{row.floor_ms:.0f}",
            _times(row.ratio),
            f"{row.samples}",
        )
        for row in run.rows
    )
    shape = run.shape
    note = (
        f"A window of {shape.chunks} random-token pages of {shape.tokens} tokens ({run.window_tokens} "
        "tokens) on the realistic shape, default settings. op: the op itself (its forwards included); "
        "TTFT: the ask after it (max_new_tokens=1): placing what changed, appending it to the retained "
        "cache, the query's forward; floor: the query's forward alone over the same assembled KV, "
        "timed right after (faster of two); placed: window tokens the ask placed (tokens_placed). "
        "Medians over the samples."
    )
    columns = ("op", "placed", "op ms", "TTFT ms", "floor ms", "TTFT / floor", "samples")
    return Grid("Time to first token after an op, against its floor", columns, rows, note)


def agent_grids(suite: AgentsRun) -> list[Grid]:
    """A table per agent, the by-op breakdown, then time to first token against its floor."""
    grids = [agent_grid(suite, agent) for agent in suite.agents]
    extra = (kind_grid(suite), time_grid(suite), ttft_grid(suite))
    return [grid for grid in (*grids, *extra) if grid is not None]


_REALISTIC = "realistic shape, defaults vs prefix cache"
_CLAIMS: tuple[tuple[str, str, float, str], ...] = (
    ("stream", "tokens", 1.05, "stream: kamera prefills <= 1.05x the prefix cache's tokens (push-only)"),
    ("video", "ms", 6.0, f"video: wall time >= 6x lower ({_REALISTIC})"),
    ("video", "tokens", 10.0, f"video: >= 10x fewer tokens prefilled ({_REALISTIC})"),
    ("web", "ms", 2.0, f"web: wall time >= 2x lower ({_REALISTIC})"),
    ("document", "ms", 2.0, f"document: wall time >= 2x lower ({_REALISTIC})"),
)
"""(agent, figure, bound, claim): each judged on the realistic shape, kamera at its defaults."""


def agent_targets(suite: AgentsRun | None) -> list[Target]:
    """The agents' claims on the realistic shape, kamera at its defaults against the prefix cache;
    then time to first token after an op against its floor."""
    return [*(_judge(suite, *claim) for claim in _CLAIMS), _ttft_target(suite)]


_TTFT_BOUND = 1.1


def _ttft_target(suite: AgentsRun | None) -> Target:
    run = suite.ttft if suite is not None else None
    claim = f"TTFT after an op <= {_TTFT_BOUND}x its floor (8 x 2048-token window, realistic shape)"
    if run is None or not run.rows:
        return Target(claim, "not run", None)
    worst = max(run.rows, key=lambda row: row.ratio)
    measured = f"worst {worst.ratio:.2f}x ({worst.op}: {worst.ttft_ms:.0f} vs {worst.floor_ms:.0f} ms)"
    if suite is not None and suite.quick:
        return Target(claim, f"{measured}; not judged (quick sizes)", None)
    return Target(claim, measured, worst.ratio <= _TTFT_BOUND)


def _judge(suite: AgentsRun | None, agent: str, name: str, bound: float, claim: str) -> Target:
    run = suite.find(agent, "realistic") if suite is not None else None
    if run is None or not run.records:
        return Target(claim, "not run", None)
    measured, holds = _measure(run, name, bound)
    if not run.complete:
        return Target(
            claim, f"{measured}; not judged (partial: {len(run.records)}/{run.steps_requested} steps)", None
        )
    if suite is not None and suite.quick:
        return Target(claim, f"{measured}; not judged (quick sizes)", None)
    return Target(claim, measured, holds)


def _measure(run: AgentRun, name: str, bound: float) -> tuple[str, bool]:
    """The claim's figure in words (the other figures beside it) and whether it holds."""
    ms, tokens = (run.total(side, "ms") / 1e3 for side in (PREFIX, "kamera")), run.ratio("tokens", "kamera")
    wall = "wall {:.1f} s vs {:.1f} s".format(*ms) + f" ({run.ratio('ms', 'kamera'):.2f}x)"
    count = f"tokens {run.total(PREFIX, 'tokens'):.0f} vs {run.total('kamera', 'tokens'):.0f} ({tokens:.2f}x)"
    ratio, exact = run.ratio(name, "kamera"), run.ratio(name, SIDES[1])
    if run.agent == "stream":  # kamera's tokens over the prefix cache's: at most the bound
        return (
            f"kamera/prefix tokens {1 / ratio:.3f} (exact settings {1 / exact:.3f}); {wall}",
            1 / ratio <= bound,
        )
    return f"{ratio:.2f}x (exact settings {exact:.2f}x); prefix vs kamera {count}, {wall}", ratio >= bound
