"""The drift budget's frontier on real agents' traffic: agents-replay's policies at several ε.

Why: `kamera bench --suite agents-replay` judges kamera at its defaults only, and on both real
models the calibrated ε (0.2) let nothing these policies change stand, so the defaults cost what
the prefix cache costs. Whether a looser budget would pay on this traffic, and at what answer
fidelity, is what the default ε must be picked from (issue 51's frontier on the sliding and
drop-old-screens policies). Each setting is a kamera server of its own (its own store: what one
formed is never another's to reuse), its requests carrying the setting as
``kamera.drift_budget``, beside the same server as a prefix cache (a re-prefill's answer at
every step); the settings run in turn at every step, the prefix side first. Per step: every
forward's tokens, the first answer token against the prefix side's, the next-token
KL(prefix ‖ setting) of both servers' answers (they run in this process), and what the budget
did (its audits and fixes, the edits by kind, the largest estimate the answer read).

    .venv/bin/python benchmarks/replay_frontier.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --policies latest-8 keep-3-batched --steps 12 \
        --json docs/results/calibration/replay-frontier-smollm2.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from rich.table import Table

from kamera_agent.bench.agents.text_contents import TEXT_LENGTHS, TextContents
from kamera_agent.bench.common import show_and_save
from kamera_agent.config import WindowConfig
from kamera_agent.divergence import next_token_kl
from kamera_agent.loading import load_backend
from kamera_agent.replay.live import LiveServer
from kamera_agent.replay.policies import POLICIES, Messages
from kamera_agent.replay.run import ANSWER_START
from kamera_agent.replay.screens import TreeScreens
from kamera_agent.serve import KameraServer, ServeSettings
from kamera_agent.serve.command import read_chat_template
from kamera_agent.settings import configure_threads

PREFIX = "prefix"
DEFAULTS = "defaults"
ANSWER = "answer:"
"""A setting's prefix naming an answer budget (a next-token KL) instead of a drift budget."""
BUDGET_WORK = ("audits", "audit_tokens", "drift_recomputes", "drift_fixes")
"""What each step's ops spent holding the budget, recorded beside its edits by kind, the audits
it measured (each chunk's own relative KV error, before the calibration's scale) and the largest
drift estimate its answer read: whether a budget re-prefilled a drop without trying (no audits)
or tried it and fixed it, and how far over ε its estimates were."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a text model's checkpoint folder or GGUF file")
    parser.add_argument("--chat-template", default=None, help="as kamera serve takes it")
    parser.add_argument(
        "--policies", nargs="+", choices=sorted(POLICIES), default=["latest-8", "keep-3-batched"]
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--budgets",
        nargs="+",
        type=_budget,
        default=[DEFAULTS, "0.3", "0.5", "1.0", "none"],
        help="drift budgets: 'defaults' (the calibration's), a relative KV error, 'answer:KL' (an answer "
        "budget: `WindowConfig.answer_budget`) or 'none' (unbounded)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    backend = load_backend(args.model, chat_template=read_chat_template(args.chat_template))
    servers = {PREFIX: LiveServer(_logged(backend, PREFIX))}
    servers |= {budget: LiveServer(_logged(backend, "kamera")) for budget in args.budgets}
    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    try:
        for index, policy in enumerate(args.policies):
            screens = TreeScreens(TextContents(backend.encoder, TEXT_LENGTHS, args.seed + 1000 * index))
            for step, messages in enumerate(POLICIES[policy].requests(screens, args.steps)):
                rows.extend(_step(servers, policy, step, messages, args.budgets))
                spent = time.perf_counter() - began
                print(f"{policy} step {step + 1}/{args.steps}, {spent:.0f} s", flush=True)
    finally:
        for live in servers.values():
            live.stop()
    summary = _summaries(rows, args.policies, args.budgets)
    table = Table(title=f"Drift budget on agents-replay traffic ({args.steps} steps, {args.model})")
    columns = ("policy", "budget", "tokens", "prefix / it", "top-1", "KL mean", "KL max", "wall / prefix")
    for column in columns:
        table.add_column(column, justify="left" if column in ("policy", "budget") else "right")
    for row in summary:
        table.add_row(
            row["policy"],
            row["budget"],
            f"{row['tokens']:,}",
            f"{row['token_ratio']:.2f}×",
            f"{100 * row['agreement']:.1f} %",
            f"{row['kl_mean']:.1e}",
            f"{row['kl_max']:.1e}",
            f"{row['wall_over_prefix']:.3f}×",
        )
    report = {
        "command": "python benchmarks/replay_frontier.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "steps": args.steps,
        "threads": args.threads,
        "seconds": time.perf_counter() - began,
        "summaries": summary,
        "records": rows,
    }
    show_and_save(table, report, args.json)
    return report


def _budget(given: str) -> str:
    if given in (DEFAULTS, "none"):
        return given
    try:
        if float(given.removeprefix(ANSWER)) > 0:
            return given
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"{given!r}: 'defaults', 'none', a relative KV error above 0 or 'answer:' and a KL above 0"
    )


def _setting(budget: str) -> dict[str, Any]:
    """The request's ``kamera`` object for a budget setting."""
    if budget.startswith(ANSWER):
        return {"answer_budget": float(budget.removeprefix(ANSWER))}
    return {"drift_budget": None if budget == "none" else float(budget)}


def _step(
    servers: dict[str, LiveServer], policy: str, step: int, messages: Messages, budgets: list[str]
) -> list[dict[str, Any]]:
    """One step: the prefix side, then each budget's session on the kamera server."""
    reference = _ask(servers[PREFIX], messages, policy, None)
    out = []
    for budget in budgets:
        asked = _ask(servers[budget], messages, policy, budget)
        kl = next_token_kl(reference["logits"], asked["logits"])
        out.append(
            {
                "policy": policy,
                "step": step,
                "budget": budget,
                "prefilled": asked["prefilled"],
                "prefix_prefilled": reference["prefilled"],
                "budget_work": asked["budget_work"],
                "largest": asked["largest"],
                "audited": asked["audited"],
                "agrees": asked["answer"] == reference["answer"],
                "kl": float(kl),
                "seconds": asked["seconds"],
                "prefix_seconds": reference["seconds"],
            }
        )
    return out


def _ask(live: LiveServer, messages: Messages, session: str, budget: str | None) -> dict[str, Any]:
    """One greedy answer token through the official client, and the logits its window read."""
    extra: dict[str, Any] = {"session_id": session, "continue_final_message": True}
    extra["add_generation_prompt"] = False
    if budget not in (None, DEFAULTS):
        extra["kamera"] = _setting(budget)
    before = len(_audits(live.server))
    began = time.perf_counter()
    reply = live.client.chat.completions.create(
        model="m",
        messages=[*messages, {"role": "assistant", "content": ANSWER_START}],  # type: ignore[list-item]
        temperature=0,
        max_tokens=1,
        extra_body=extra,
    )
    seconds = time.perf_counter() - began
    kamera = reply.model_extra["kamera"]
    work = {name: sum(int(op.get(name, 0)) for op in kamera["ops"]) for name in BUDGET_WORK}
    audited = _audits(live.server)
    edits: dict[str, int] = {}
    for op in kamera["ops"]:
        for kind, count in op["edits"].items():
            edits[kind] = edits.get(kind, 0) + int(count)
    return {
        "answer": reply.choices[0].message.content or "",
        "prefilled": int(kamera["tokens_prefilled"]),
        "budget_work": {**work, **{f"edits.{kind}": count for kind, count in sorted(edits.items())}},
        "largest": kamera["drift"].get("largest"),
        "audited": audited[before:],
        "seconds": seconds,
        "logits": live.server.first_logits.float(),
    }


def _logged(backend: Any, reuse: str) -> KameraServer:
    """A server (``reuse``: kamera or prefix) that keeps its last answer's first-token logits."""
    server = KameraServer(backend, ServeSettings("m", WindowConfig(), max_tokens=1, reuse=reuse))
    decode, make = server._decode, server.sessions._make
    server.windows = []  # type: ignore[attr-defined]

    def made(*args: Any, **kwargs: Any) -> Any:
        window = make(*args, **kwargs)
        server.windows.append(window)  # type: ignore[attr-defined]
        return window

    def decoded(*args: Any, **kwargs: Any) -> Any:
        answers = decode(*args, **kwargs)
        server.first_logits = answers[0].first_logits  # type: ignore[attr-defined]
        return answers

    server._decode = decoded  # type: ignore[method-assign]
    server.sessions._make = made
    return server


def _audits(server: Any) -> list[float]:
    """Every audit the server's windows' budgets remember, oldest first (one window per setting
    here: each setting is a server of its own, with one session)."""
    budgets = [window._parts.budget for window in server.windows]
    return [audit for budget in budgets if budget is not None for audit in budget.audited()]


def _summaries(rows: list[dict[str, Any]], policies: list[str], budgets: list[str]) -> list[dict[str, Any]]:
    out = []
    for policy in policies:
        for budget in budgets:
            mine = [r for r in rows if r["policy"] == policy and r["budget"] == budget]
            tokens, prefix = sum(r["prefilled"] for r in mine), sum(r["prefix_prefilled"] for r in mine)
            out.append(
                {
                    "policy": policy,
                    "budget": budget,
                    "steps": len(mine),
                    "tokens": tokens,
                    "prefix_tokens": prefix,
                    "token_ratio": prefix / max(1, tokens),
                    "agreement": statistics.fmean(r["agrees"] for r in mine),
                    "kl_mean": statistics.fmean(r["kl"] for r in mine),
                    "kl_max": max(r["kl"] for r in mine),
                    "wall_over_prefix": statistics.median(r["seconds"] / r["prefix_seconds"] for r in mine),
                }
            )
    return out


if __name__ == "__main__":
    main()
