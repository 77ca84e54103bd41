"""kamera's vLLM connector end to end on vLLM's real engine (its CPU build, run in .venv-vllm).

Each setting runs in a fresh interpreter (`scenario.py`): vLLM's scheduler, block allocator,
prefix cache and CPU attention kernel, a tiny Qwen2 checkpoint saved here, greedy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from kamera_agent.engines.stores import STORE_DIR_VARIABLE
from tests.engines.vllm.scenario import kl

ROOT = Path(__file__).resolve().parents[3]
EXACT = 2e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 (4 layers, head 32: vLLM's CPU attention needs it) whose chunks
    condition measurably (weights at std 0.08), with the byte-level tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kamera_agent.models.tiny_tokenizer import build_byte_tokenizer

    path = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = build_byte_tokenizer(model_max_length=4096)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@cache
def _run(model: str, settings: str, corrupt: bool = False, inject: str = "") -> dict[str, Any]:
    out = Path(model) / f"report-{settings}-{corrupt}-{inject}.json"
    command = [
        sys.executable,
        "-m",
        "tests.engines.vllm.scenario",
        "--model",
        model,
        "--settings",
        settings,
    ]
    command += (
        ["--out", str(out)] + (["--corrupt"] if corrupt else []) + (["--inject", inject] if inject else [])
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env[STORE_DIR_VARIABLE] = str(Path(model) / f"stores-{settings}-{corrupt}-{inject}")  # a run's own
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


def test_exact_settings_answer_like_vllm_alone_and_load_the_models_own_kv(model_dir: Path) -> None:
    alone, exact = _run(str(model_dir), "none"), _run(str(model_dir), "exact")
    for conversation in ("sliding", "growing"):
        assert [r["tokens"] for r in exact[conversation]] == [r["tokens"] for r in alone[conversation]]
    growing = exact["growing"]
    # vLLM's prefix cache was reset before each request: the store served what came before
    assert all(r["external"] > 0 for r in growing[1:]), growing
    assert all(r["computed"] < a["computed"] for r, a in zip(growing[1:], alone["growing"][1:], strict=True))
    checks = [r["kv_check"] for r in growing[1:]]
    assert all(c["tokens"] > 0 and c["worst_relative_error"] < EXACT for c in checks), checks
    # loaded off the step: vLLM parked each loaded request until the connector reported it done
    assert exact["async_loads"] >= len(growing) - 1, exact["async_loads"]
    # the connector declares SupportsHMA: vLLM keeps its hybrid KV cache manager on, as alone
    assert exact["hybrid_manager_on"] and alone["hybrid_manager_on"]


@pytest.mark.parametrize("settings", ["exact", "defaults"])
def test_every_request_held_for_its_captures_is_freed(model_dir: Path, settings: str) -> None:
    """On vLLM's CPU build a request's captured blocks are copied off the step while vLLM holds
    them past its end; once copied every request is freed and every block is free again."""
    drained = _run(str(model_dir), settings)["drained"]
    assert drained["requests"] == 0 and drained["free_blocks"] == drained["free_at_start"], drained


def test_unbounded_keep_loads_moved_chunks_of_a_sliding_conversation(model_dir: Path) -> None:
    """``drift_budget=None``: kept states served wherever the store holds them, their drift unknown."""
    alone, defaults = _run(str(model_dir), "none"), _run(str(model_dir), "unbounded")
    sliding, baseline = defaults["sliding"], alone["sliding"]
    reports = [r["served"] for r in sliding]
    assert all(r["kept_tokens"] > 0 and r["drift"] is None for r in reports[1:]), reports
    assert sliding[0]["external"] == 0  # nothing known yet: vLLM's own path
    assert all(r["external"] > 0 for r in sliding[1:]), [r["external"] for r in sliding]
    computed, computed_alone = sum(r["computed"] for r in sliding), sum(r["computed"] for r in baseline)
    assert computed < computed_alone
    pairs = list(zip(baseline, sliding, strict=True))
    wall, wall_alone = sum(r["seconds"] for r in sliding[1:]), sum(r["seconds"] for r in baseline[1:])
    divergence = [kl(a["first_logprobs"], r["first_logprobs"]) for a, r in pairs]
    agree = sum(a["tokens"] == r["tokens"] for a, r in pairs)
    print(
        f"unbounded keep, sliding conversation: computed {computed} vs {computed_alone} prompt tokens; "
        f"wall time of requests 2-9 {1000 * wall:.0f} vs {1000 * wall_alone:.0f} ms; "
        f"first-token KL mean {sum(divergence) / len(divergence):.3g}, max {max(divergence):.3g}; "
        f"answers equal {agree}/{len(sliding)}",
        file=sys.stderr,
    )
    assert divergence[0] < 1e-6  # the first request is vLLM's own computation
    # kept loads are recorded only from the workers' report that they were written (vLLM's
    # worker-to-scheduler metadata), and every offer was reported by the end
    connector = defaults["connector"]
    assert connector["recorded"] > 0 and connector["unconfirmed"] == 0, connector
    # unsalted, the same conversation is served exactly: vLLM's own answers
    assert [r["tokens"] for r in defaults["unsalted"]] == [r["tokens"] for r in baseline]


def test_the_default_budget_serves_kept_states_only_where_filed_audits_vouch(model_dir: Path) -> None:
    """At the default drift budget a kept state is served only where an audit filed in the store
    (here by the scenario, as a window sharing the store files one: the kept KV against the
    transformers model's own) puts its estimate within ε, the kept chunks to its left counted
    (`Calibration.estimate`): with none filed the sliding conversation answers as vLLM alone;
    in the reordered one, each request is served exactly the kept chunks the audits vouch for,
    and says so in its ``kv_transfer_params``."""
    from tests.engines.vllm.scenario import EPSILON

    alone, run = _run(str(model_dir), "none"), _run(str(model_dir), "defaults")
    assert [r["tokens"] for r in run["sliding"]] == [r["tokens"] for r in alone["sliding"]]
    reports = [r["served"] for r in run["sliding"]]
    assert all(r["kept_tokens"] == 0 and r["drift"] == 0.0 for r in reports), reports
    assert all(r["kept_refused"] for r in reports[1:]), reports  # nothing vouched for them
    lines, vouched = [], 0
    for audits, r, a in zip(run["audits"], run["reordered"], alone["reordered"], strict=True):
        worst, expected = 0.0, []
        for audit in audits:  # the chain rule: scale 1, half the largest estimate to the left
            estimate = audit["error"] + 0.5 * worst
            if estimate > EPSILON:
                break
            expected.append(estimate)
            worst = max(worst, estimate)
        served = r["served"]
        assert served["drift"] == pytest.approx(max(expected, default=0.0)) and served["drift"] <= EPSILON
        assert (served["kept_tokens"] > 0) == bool(expected) and served["kept_refused"] == (
            len(expected) < len(audits)
        )
        if expected:
            assert r["computed"] < a["computed"] and r["external"] > 0
        vouched += len(expected)
        divergence = kl(a["first_logprobs"], r["first_logprobs"])
        lines.append(
            f"computed {r['computed']:.0f} vs {a['computed']:.0f}, kept {served['kept_tokens']}, "
            f"drift {served['drift']:.3f}, first-token KL {divergence:.2g}, "
            f"answer {'equal' if r['tokens'] == a['tokens'] else 'differs'}"
        )
    assert vouched > 0  # this model's first kept chunk of a request is within the scenario's ε
    errors = [round(audit["error"], 3) for audits in run["audits"] for audit in audits]
    print(f"default budget (eps {EPSILON}): kept chunks' audited errors {errors}", file=sys.stderr)
    print("reordered at the default budget: " + "; ".join(lines), file=sys.stderr)


def test_a_damaged_entry_is_never_loaded(model_dir: Path) -> None:
    alone, damaged = _run(str(model_dir), "none"), _run(str(model_dir), "exact", corrupt=True)
    assert [r["tokens"] for r in damaged["growing"]] == [r["tokens"] for r in alone["growing"]]
    worker = damaged["connector"]["worker"]
    assert worker["failed"] > 0, worker  # damaged entries were offered, refused when read


def test_a_window_and_the_connector_serve_each_other_from_one_store(model_dir: Path) -> None:
    """One key and state scheme: a conversation a window held is loaded by vLLM, and one vLLM
    computed is pushed into a window without a forward, each within rounding of the model's KV."""
    shared = _run(str(model_dir), "exact")["shared"]
    to_vllm = shared["to_vllm"]
    assert shared["window_forwards"] > 0  # the window made the notes' KV itself
    assert to_vllm["external"] > 0 and to_vllm["kv_check"]["tokens"] > 0, to_vllm
    assert to_vllm["kv_check"]["worst_relative_error"] < EXACT, to_vllm["kv_check"]
    assert shared["reader_forwards"] == 0 and shared["reader_tokens_reused"] > 0, shared
    assert shared["reader_worst_relative_error"] < EXACT, shared
    print(
        f"shared store: vLLM loaded {to_vllm['external']:.0f} window-made tokens "
        f"(worst relative error {to_vllm['kv_check']['worst_relative_error']:.2g}); a window pushed "
        f"{shared['reader_tokens_reused']} vLLM-captured tokens with no forward "
        f"(worst {shared['reader_worst_relative_error']:.2g})",
        file=sys.stderr,
    )


def test_the_old_connector_path_still_loads_with_a_warning() -> None:
    """``kv_connector_module_path="kamera_agent.backends.vllm.connector"`` in a user's settings."""
    from tests.test_moved import import_in_fresh_interpreter

    done = import_in_fresh_interpreter("kamera_agent.backends.vllm.connector")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "moved to kamera_agent.engines.vllm.connector" in done.stdout


SCHEDULER_HOOKS = "_matched,_allocated,_plan_saves,_forget,_capture"


def test_faults_in_every_hook_never_fail_a_request(model_dir: Path) -> None:
    """Each connector hook's body raises IndexError, AttributeError, ValueError, KeyError and a
    store timeout in turn (every other call): vLLM finishes every request and every fault is
    counted at its hook's boundary. Where a fault makes kamera offer nothing or skip a capture
    (the scheduler side, captures), every answer equals vLLM alone; a failed *load* is reported
    to vLLM as such (its recompute policy), which does not always answer as vLLM alone does
    when some of a request's loads fail and others do not (docs/vllm.md)."""
    alone = _run(str(model_dir), "none")
    degraded = _run(str(model_dir), "exact", inject=SCHEDULER_HOOKS)
    for part in ("sliding", "growing"):
        assert [r["tokens"] for r in degraded[part]] == [r["tokens"] for r in alone[part]], part
    everything = _run(str(model_dir), "exact", inject="all")
    for part in ("sliding", "growing"):
        assert len(everything[part]) == len(alone[part]) and all(r["tokens"] for r in everything[part])
    hooks = {key.split(":")[0] for key in everything["faults"]}
    assert {
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "request_finished",
        "start_load_kv",
        "wait_for_save",
    } <= hooks, everything["faults"]
    kinds = {key.split(":")[1] for key in everything["faults"]}
    assert {"IndexError", "AttributeError", "ValueError", "KeyError", "TimeoutError"} <= kinds
    for run in (degraded, everything):  # a faulted capture still releases its request
        drained = run["drained"]
        assert drained["requests"] == 0 and drained["free_blocks"] == drained["free_at_start"], drained
