"""docs/results.md's tables for the agents suites and kamera's wall beside a prefix cache's, from
a stored run's JSON.

Why apart from `kamera_agent.bench.published`: that module decides what a document holds and
where (sections, the README's block); this one only turns the two agent suites' figures into
tables, from the JSON alone, so a figure in the document is always one the run recorded.
"""

from __future__ import annotations

from typing import Any

from kamera_agent.bench.tables import num_cell, percent_cell

__all__ = [
    "REPLAY_COLUMNS",
    "agents_tables",
    "markdown_table",
    "overhead_table",
    "replay_rows",
    "replay_table",
]

_PREFIX = "prefix"


def agents_tables(agents: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """Each agent's sides (tokens, wall, first-token agreement and KL against the reference),
    then the same by step kind."""
    model = "the realistic shape and the demo model" if agents.get("realistic_shape") else "this model"
    lines = [
        f"Agents on {model}: kamera at its defaults and exact (and, on a real text model, "
        "`kamera-unbounded`: the defaults' policies with no drift budget, **unbounded**) beside a "
        "prefix cache, every step run on "
        f"each side in rotating order, over {agents.get('content', 'the demo task')}; after every step "
        "each kamera side's first answer token and next-token KL are checked against the reference "
        "(the model's own re-prefill unless the row says otherwise).",
        "",
        "| agent | model | side | steps | tokens | wall s | tokens / prefix | wall / prefix | top-1 | "
        "KL mean | KL max |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for agent in agents["runs"]:
        prefix = agent["sides"][_PREFIX]["totals"]
        for side, entry in agent["sides"].items():
            totals, fidelity = entry["totals"], entry.get("fidelity", {})
            lines.append(
                f"| {agent['agent']} | {agent['model']} | {side} | {agent['steps_done']} | "
                f"{num_cell(totals['tokens'], ',.0f')} | {num_cell(totals['ms'] / 1e3, '.1f')} | "
                f"{_ratio(totals['tokens'], prefix['tokens'])} | {_ratio(totals['ms'], prefix['ms'])} | "
                f"{percent_cell(fidelity.get('agreement'))} | {num_cell(fidelity.get('kl_mean'), '.1e')} | "
                f"{num_cell(fidelity.get('kl_max'), '.1e')} |"
            )
    sizes = "; ".join(
        f"{agent['agent']}: " + ", ".join(f"{kind} {n}" for kind, n in agent["tokens_per_chunk"].items())
        for agent in agents["runs"]
        if agent["model"] != "demo"
    )
    lines += ["", f"Tokens per chunk: {sizes}.", "", *_by_kind(agents)]
    return lines


def _by_kind(agents: dict[str, Any]) -> list[str]:
    kamera = [side for side in agents["runs"][0]["sides"] if side != _PREFIX] if agents["runs"] else []
    head = "| agent | model | step kind | steps | prefix tokens | " + " | ".join(
        f"{side} tokens | {side} top-1 / KL mean" for side in kamera
    )
    lines = [
        "By step kind (tokens prefilled over the steps of that kind; top-1 and mean KL of the checks "
        "after them):",
        "",
        head + " |",
        "|---|---|---|---:|---:|" + "---:|---:|" * len(kamera),
    ]
    for agent in agents["runs"]:
        kinds = {side: agent["sides"][side]["by_kind"] for side in agent["sides"]}
        for kind, prefix in kinds[_PREFIX].items():
            cells = [
                agent["agent"],
                agent["model"],
                kind,
                str(prefix["steps"]),
                num_cell(prefix["tokens"], ",.0f"),
            ]
            for side in kamera:
                entry = kinds[side][kind]
                cells += [
                    num_cell(entry["tokens"], ",.0f"),
                    f"{percent_cell(entry['agreement'])} / {num_cell(entry['kl_mean'], '.1e')}",
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


REPLAY_COLUMNS = (
    "model",
    "policy",
    "steps",
    "prefix tokens",
    "kamera tokens",
    "tokens / prefix",
    "passes",
    "wall / prefix",
    "each pass",
    "in the forwards",
    "rest ms / step (kamera · prefix)",
    "top-1",
)
"""The replay table's columns (docs/results.md's and the ``agents-replay.md`` its command writes)."""


def replay_table(replay: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """Per model and policy: both servers' prefilled tokens, kamera's wall over the prefix
    server's (the median of per-step ratios over every pass, and each pass's), each side's wall
    outside the forwards, first-token agreement."""
    wall = (
        "the median over every step of every pass of kamera's wall over the prefix server's for that step"
        if "passes" in replay
        else "kamera's total wall over the prefix server's (one pass, its steps' ratios not kept)"
    )
    lines = [
        f"Agents replay: {replay['steps']} steps per policy sent through `kamera serve` with the openai "
        "client, kamera at its defaults beside the same server as a prefix cache (`--reuse prefix`), "
        "the two alternating step by step and pass by pass (each pass on fresh servers); wall / "
        f"prefix: {wall} (< 1: kamera is faster); each pass: that pass's total wall ratio; in the "
        "forwards: the same median for the time inside the model's forwards alone, which run the "
        "same shapes on both sides where tokens are equal (how far the machine's noise goes); rest: "
        "each side's wall outside the forwards per step (median; HTTP included), its own work; "
        "top-1: the share of steps whose one greedy answer token is the prefix server's (a "
        f"re-prefill's){_continuing(replay)}.",
        "",
        *markdown_table(REPLAY_COLUMNS, replay_rows(replay)),
    ]
    return lines


def replay_rows(replay: dict[str, Any]) -> list[tuple[str, ...]]:
    """The replay table's rows, one per model and policy (a stored run of one pass, from before
    passes were counted, renders its totals' ratio and no rest)."""
    out: list[tuple[str, ...]] = []
    for row in replay["summaries"]:
        tokens, seconds = row["tokens"], row["seconds"]
        wall = row.get("wall_over_prefix", seconds["kamera"] / max(1e-9, seconds["prefix"]))
        passes = row.get("pass_walls", [wall])
        rest = row.get("rest_ms", {})
        out.append(
            (
                str(row["model"]),
                str(row["policy"]),
                str(row["steps"]),
                num_cell(tokens["prefix"], ",.0f"),
                num_cell(tokens["kamera"], ",.0f"),
                _ratio(tokens["kamera"], tokens["prefix"]),
                str(row.get("passes", 1)),
                f"{wall:.3f}×",
                " · ".join(f"{each:.3f}" for each in passes),
                num_cell(row.get("in_forwards"), ".3f"),
                f"{num_cell(rest.get('kamera'), '.0f')} · {num_cell(rest.get('prefix'), '.0f')}",
                percent_cell(row["agreement"]),
            )
        )
    return out


def markdown_table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """A markdown table: the first two columns left-aligned (names), the rest right-aligned."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * 2 + "---:|" * (len(columns) - 2)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def overhead_table(overhead: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """Per agent: kamera's wall over the prefix cache's (the median of alternating runs, and
    each run's), tokens and forwards on both sides, and each side's wall outside the forwards."""
    lines = [
        f"kamera under `{overhead['settings']}` beside the prefix cache, both in one process over "
        f"{run['args']['model']}, the side order alternating step by step and run by run; wall / "
        "prefix: the median over runs of kamera's wall over the prefix cache's (< 1: kamera is "
        "faster); in the forwards: each run's ratio of the time inside the model's forwards alone, "
        "which run the same shapes on both sides where tokens are equal; rest: each side's wall "
        "outside the forwards, per step (its own work).",
        "",
        "| agent | steps | kamera tokens | prefix tokens | tokens / prefix | forwards (kamera · prefix) | "
        "wall / prefix | each run | in the forwards | rest ms / step (kamera · prefix) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for agent, row in overhead["agents"].items():
        tokens, forwards, rest = row["tokens"], row["forwards"], row["rest_ms_per_step"]
        runs = " · ".join(f"{entry['wall_ratio']:.3f}" for entry in row["runs"])
        inside = " · ".join(
            f"{entry['kamera']['forward_ms'] / entry['prefix']['forward_ms']:.3f}" for entry in row["runs"]
        )
        lines.append(
            f"| {agent} | {row['steps']} | {num_cell(tokens['kamera'], ',.0f')} | "
            f"{num_cell(tokens['prefix'], ',.0f')} | {_ratio(tokens['kamera'], tokens['prefix'])} | "
            f"{forwards['kamera']} · {forwards['prefix']} | {num_cell(row['wall_ratio'], '.3f')}× | {runs} | "
            f"{inside} | {num_cell(rest['kamera'], '.1f')} · {num_cell(rest['prefix'], '.1f')} |"
        )
    return lines


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}×" if theirs else "—"


def _continuing(replay: dict[str, Any]) -> str:
    """The opening the replay's answers continued, where its run recorded one."""
    opening = replay.get("answer_start")
    return f", the answer continuing the opening `{opening}` (`continue_final_message`)" if opening else ""
