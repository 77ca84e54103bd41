"""The benchmarks keep running: each is executed at a toy size (figures are not asserted here)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(name: str, args: list[str]) -> None:
    """``benchmarks/<name>.py`` with ``args`` in a fresh interpreter: 1 thread, offline."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        check=False,
        env={"KAMERA_NUM_THREADS": "1", "PATH": "", "HF_HUB_OFFLINE": "1", **_search_path()},
    )
    assert result.returncode == 0, result.stderr


def _search_path() -> dict[str, str]:
    """The caller's ``PYTHONPATH`` (a checkout run beside an installed copy imports its own)."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": path} if path else {}


def test_operator_benchmark_runs_and_reports_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "operator.json"
    toy = "--tokens 64 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --mlp 128 --vocab 256"
    args = [*toy.split(), "--ranks", "4", "8", "--repeats", "1", "--antecedent", "16", "--json", str(out)]
    run_benchmark("operator", args)
    report = json.loads(out.read_text())
    assert [row["rank"] for row in report["ranks"]] == [4, 8]
    assert report["prefill_ms"] > 0 and report["relocate_ms"] > 0
    for row in report["ranks"]:
        assert 0 < row["patch_fraction_of_kv"] < 1


def test_planning_benchmark_reports_every_op_at_every_size(tmp_path: Path) -> None:
    out = tmp_path / "planning.json"
    args = ["--chunks", "4", "8", "--repeats", "3", "--json", str(out)]
    run_benchmark("planning", args)
    report = json.loads(out.read_text())
    assert set(report["median_ms"]) == {"4", "8"}
    for row in report["median_ms"].values():
        assert set(row) == {"push", "reorder", "slide", "evict", "recall"}
        assert all(ms > 0 for ms in row.values())


def test_window_memory_benchmark_drops_pixels_beside_keeping_them(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    args = ["--images", "12", "--capacity", "3", "--json", str(out)]
    run_benchmark("window_memory", args)
    rows = json.loads(out.read_text())["rows"]
    assert rows["keep"]["pixel_mb"] > rows["drop"]["pixel_mb"] > 0  # the in-window frames keep theirs
    assert rows["keep"]["chunks_remembered"] == rows["drop"]["chunks_remembered"] == 12


def test_agent_settings_benchmark_runs_a_variant_beside_the_defaults(tmp_path: Path) -> None:
    out = tmp_path / "variant.json"
    keep = [
        "--set",
        "cascade=keep",
        "--set",
        "drift_budget=null",
    ]  # unbounded: the random model is uncalibrated
    args = ["--quick", "--agent", "document", *keep, "--json", str(out)]
    run_benchmark("agent_settings", args)
    report = json.loads(out.read_text())
    assert report["variant"] == {"cascade": "keep", "drift_budget": None} and set(report["sides"]) == {
        "kamera",
        "variant",
        "prefix",
    }
    sides = report["sides"]
    assert all(side["ms"] > 0 and side["tokens"] > 0 for side in sides.values())
    assert sides["variant"]["tokens"] < sides["kamera"]["tokens"]  # keep re-forms nothing on recall


def test_remote_store_benchmark_fetches_what_it_stored(tmp_path: Path) -> None:
    out = tmp_path / "remote.json"
    run_benchmark("remote_store", ["--quick", "--tokens", "32", "--repeats", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["prefill_ms"] > 0 and report["fetch_ms"] > 0
    # a warm-up and 5 timed fetches, every one from the server (nothing is kept in memory)
    assert report["remote_hits"] == 6 and report["remote_misses"] == 0


def test_gpu_check_script_runs_every_check_at_toy_size(tmp_path: Path) -> None:
    """The prepared GPU script (issues 12 and 14) stays runnable where no GPU is lent."""
    out = tmp_path / "gpu.json"
    run_benchmark("gpu_check", ["--quick", "--passes", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(report["video"]) == {"kamera", "kamera-exact", "prefix"}
    assert len(report["video_passes"]) == 2 and report["video_passes"][0] == report["video"]
    assert report["ttft"]["rows"] and all(row["floor_ms"] > 0 for row in report["ttft"]["rows"])
    turns = report["serve"]["turns"]
    assert len(turns) == 6 and all(t["prompt_tokens_details"]["cached_tokens"] > 0 for t in turns[1:])


def test_the_sglang_gpu_check_prepares_its_servers_and_requests() -> None:
    """The prepared SGLang GPU script (issue 13) builds its launches and its conversation here;
    the servers themselves need a GPU with SGLang."""
    run_benchmark("sglang_gpu_check", ["--dry-run", "--turns", "3"])


def test_the_vllm_gpu_check_prepares_its_conversation() -> None:
    """The prepared vLLM GPU script (issue 18) builds its requests here; it runs where a GPU is."""
    run_benchmark("vllm_gpu_check", ["--dry-run", "--turns", "3"])


def test_agent_settings_runs_on_the_demo_model_against_its_re_prefill(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    args = ["--quick", "--agent", "document", "--set", "cascade=keep", "--model", "demo", "--json", str(out)]
    run_benchmark("agent_settings", args)
    sides = json.loads(out.read_text())["sides"]
    assert set(sides) == {"kamera", "variant"} and all(
        0 <= s["top1"] <= 1 and s["asks"] > 0 for s in sides.values()
    )


def test_serve_overhead_benchmark_reports_each_turn(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    run_benchmark(
        "serve_overhead", ["--turns", "4", "--keep", "2", "--runs", "1", "--early", "2", "--json", str(out)]
    )
    report = json.loads(out.read_text())
    assert len(report["median_ms"]) == 4 and all(ms > 0 for ms in report["median_ms"]) and report["ratio"] > 0


def test_drift_estimator_benchmark_judges_a_calibration_on_held_out_episodes(tmp_path: Path) -> None:
    out = tmp_path / "drift.json"
    steps = tmp_path / "held.json"
    run_benchmark(
        "drift_estimator",
        ["--ops", "30", "--fit-seeds", "1", "--seeds", "2", "--json", str(out), "--steps", str(steps)],
    )
    report = json.loads(out.read_text())
    assert [row["ε"] for row in report["rows"]][:1] == [1e-3] and report["held_samples"] > 0
    assert all(0 <= row["truly within ε"] <= 1 for row in report["rows"])
    # the fitted calibration's plan-time bounds are judged on the same chunk-states
    vouch = report["vouch"].values()
    assert all(row["chunks"] == report["held_samples"] for row in vouch)
    # the saved steps are judged again without the model, by the model's own calibration
    again = tmp_path / "again.json"
    run_benchmark("drift_estimator", ["--from-steps", str(steps), "--json", str(again)])
    assert json.loads(again.read_text())["held_samples"] == report["held_samples"]


def test_overhead_benchmark_splits_every_op_into_forward_operator_and_rest(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    run_benchmark("overhead", ["--chunks", "4", "--repeats", "1", "--json", str(out)])
    ops = json.loads(out.read_text())["ops"]
    assert set(ops) == {"push", "slide", "reorder", "evict", "recall", "ask"}
    for row in ops.values():
        assert row["total_ms"] > 0 and row["forward_ms"] >= 0 and row["operator_ms"] >= 0
    assert ops["push"]["forward_ms"] > 0  # (a slide at the drift budget may audit: a forward too)


def test_overhead_against_the_prefix_cache_reports_each_agent_at_equal_tokens(tmp_path: Path) -> None:
    """Under exact settings kamera prefills what the prefix cache does (the document agent fewer,
    where a stored state serves), in as many forwards: a step of several ops is one request; the
    stored run renders in docs/results.md."""
    from kamera_agent.bench.published import render_results

    out = tmp_path / "against.json"
    run_benchmark("overhead", ["--against-prefix", "--quick", "--runs", "2", "--json", str(out)])
    run = json.loads(out.read_text())
    agents = run["suites"]["prefix-overhead"]["agents"]
    assert list(agents) == ["sliding", "video", "web", "document"]
    for name, row in agents.items():
        assert len(row["runs"]) == 2 and row["wall_ratio"] > 0
        assert row["forwards"]["kamera"] == row["forwards"]["prefix"], name
        assert row["tokens_ratio"] <= 1.0, name
        assert row["tokens_ratio"] == 1.0 or name == "document"
    assert [entry["kamera_first"] for entry in agents["sliding"]["runs"]] == [True, False]
    section = render_results({"slice-prefix-overhead.json": run})
    assert "python benchmarks/overhead.py --against-prefix --runs 2 --quick" in section
    assert f"| sliding | {agents['sliding']['steps']} |" in section


def test_engine_gpu_check_runs_its_cpu_part(tmp_path: Path) -> None:
    """The device check's own checks hold on CPU: every vLLM layout round trip bit-equal,
    relocation at fp32 rounding, the exact window's answers equal to the model's forward."""
    out = tmp_path / "engine_gpu.json"
    run_benchmark("engine_gpu_check", ["--device", "cpu", "--quick", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["ok"] and len(report["layouts"]) == 6 * 3 * 4 - 3  # FlashInfer has no LHBNC
    assert all(row["equal"] for row in report["layouts"])
    errors = {(r["dtype"], r["shift"]): r["keys_relative_error"] for r in report["relocation"]}
    assert all(e < 1e-5 for (dtype, _), e in errors.items() if dtype == "float32"), errors
    assert all(e < 2e-2 for (dtype, _), e in errors.items() if dtype == "bfloat16"), errors
    assert [r["op"] for r in report["window"]] == ["push", "reorder", "evict", "recall", "slide"]
    assert all(r["argmax_equal"] and r["kl"] < 1e-6 for r in report["window"])


def test_survivor_drift_benchmark_measures_every_survivor_after_the_change(tmp_path: Path) -> None:
    out = tmp_path / "survivors.json"
    run_benchmark("survivor_drift", ["--chunks", "4", "--ops", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    slide = [row["distance"] for row in rows if row["op"] == "slide"]
    evict = [row["distance"] for row in rows if row["op"] == "evict"]
    assert slide == [0, 1, 2, 3] and evict == [0, 1]  # every survivor from the changed slot on
    assert all(row["survivors"] == 1 and row["median"] > 0 and 0 <= row["within"] <= 1 for row in rows)


def test_slide_repair_judges_every_repair_against_the_real_models_re_prefill(tmp_path: Path) -> None:
    """On SmolLM2: the re-prefill is its own truth, keeping the survivor drifts measurably (or the
    repairs could show nothing), and a repair recomputes part of what re-prefilling computes."""
    from tests.real_env import ensure_real_models

    ensure_real_models()
    from kamera_agent.models.real import real_model_gguf

    out = tmp_path / "repair.json"
    model = str(real_model_gguf("smollm2"))
    run_benchmark("slide_repair", ["--model", model, "--seeds", "1", "--chunks", "3", "--json", str(out)])
    rules = json.loads(out.read_text())["rules"]
    assert rules["re-prefill"]["kl_max"] == 0 and rules["re-prefill"]["error_by_distance"] == [0.0]
    assert rules["kept"]["kl_max"] > 1e-5 and rules["kept"]["error_by_distance"][0] > 1e-3
    refill = rules["re-prefill"]["tokens_mean"]
    assert rules["kept"]["tokens_mean"] < rules["head 30 %"]["tokens_mean"] < refill
    assert rules["head 30 %"]["error_by_distance"][0] < rules["kept"]["error_by_distance"][0]
    assert 0 < rules["bf16 re-prefill"]["kl_max"] < 1e-1


def test_the_answer_probe_at_a_share_of_all_rows_is_the_true_kl(tmp_path: Path) -> None:
    """On SmolLM2: every audit row recomputed over the probed left is the re-prefill itself, so
    the estimate equals the true KL (the plumbing the partial shares rest on); a share of 0.3
    recomputes part of the rows and moves the answer."""
    from tests.real_env import ensure_real_models

    ensure_real_models()
    from kamera_agent.models.real import real_model_gguf

    out = tmp_path / "probe.json"
    model = str(real_model_gguf("smollm2"))
    args = ["--model", model, "--seeds", "1", "--chunks", "3", "--shares", "0.3", "1.0", "--json", str(out)]
    run_benchmark("answer_probe", args)
    (only,) = json.loads(out.read_text())["slides"]
    assert only["kl"] > 1e-5  # the kept survivor drifts measurably
    whole, part = only["estimates"]["1.0"], only["estimates"]["0.3"]
    assert whole["kl"] == pytest.approx(only["kl"], rel=1e-3)
    assert whole["moved_kl"] == pytest.approx(only["kl"], rel=1e-3)
    assert 0 < part["rows"] < whole["rows"] and part["moved_kl"] > 0
    run_benchmark("answer_probe", [*args[:-3], "1.0", "--rows", "head", "--json", str(out)])
    (head,) = json.loads(out.read_text())["slides"]  # every row from each survivor's start: all rows
    assert head["estimates"]["1.0"]["kl"] == pytest.approx(only["kl"], rel=1e-3)


def test_the_answer_judge_with_every_row_repaired_stands_on_the_re_prefill(tmp_path: Path) -> None:
    """On SmolLM2: recomputing all of each survivor's rows from its start is the re-prefill (its
    answer's KL ~0, first token equal) and leaves nothing to extrapolate (every verdict stands,
    none flipped); a share of 0.3 recomputes part of the rows, and the kept window drifts."""
    from tests.real_env import ensure_real_models

    ensure_real_models()
    from kamera_agent.models.real import real_model_gguf

    out = tmp_path / "judge.json"
    model = str(real_model_gguf("smollm2"))
    run_benchmark(
        "answer_judge",
        ["--model", model, "--seeds", "1", "--chunks", "3", "--shares", "0.3", "1.0", "--json", str(out)],
    )
    report = json.loads(out.read_text())
    (only,) = report["slides"]
    assert only["kept"]["kl"] > 1e-5
    whole, part = only["repaired"]["1.0"], only["repaired"]["0.3"]
    assert whole["kl"] < 1e-6 and whole["agrees"]
    assert whole["neutral"]["residual"] == 0.0 and whole["question"]["top_holds"]
    assert 0 < part["rows"] < whole["rows"] == only["tokens"] - only["lead"]
    assert all(v["stood"] == 1 and v["flipped"] == 0 for v in report["verdicts"]["1.0:neutral"].values())


def test_the_vllm_workloads_slide_reorder_and_hand_off_on_passages_of_their_own(tmp_path: Path) -> None:
    """`benchmarks/vllm_workloads.py --dry-run`: the requests it would send (no server)."""
    out = tmp_path / "workloads.json"
    run_benchmark("vllm_workloads", ["--dry-run", "--requests", "12", "--turns", "4", "--json", str(out)])
    plan = json.loads(out.read_text())["shapes"]
    assert {name: len(requests) for name, requests in plan.items()} == dict.fromkeys(plan, 12)
    slide = [r["messages"] for r in plan["sliding"]]
    # the system prompt, 3 passages, a question and the answer's start; the oldest passage out, one in
    assert all(len(m) == 6 and m[0].startswith("system:") for m in slide)
    assert all(later[1:3] == earlier[2:4] for earlier, later in itertools.pairwise(slide))
    rag = [r["messages"][1:-2] for r in plan["rag"]]
    assert len({p for passages in rag for p in passages}) <= 6 and all(len(set(p)) == 3 for p in rag)
    assert len({tuple(p) for p in rag}) > 6  # a new order (or draw) nearly every request
    handoff = plan["handoff"]
    assert [r["server"] for r in handoff] == ["a"] * 6 + ["b"] * 6  # 3 conversations: 2 turns on A, 2 on B
    for a, b in zip(handoff[1:6:2], handoff[6::2], strict=True):  # A's last turn of a conversation, B's first
        assert b["messages"][: len(a["messages"]) - 2] == a["messages"][:-2]  # B continues what A grew
    texts = [{m for r in plan[name] for m in r["messages"][1:-2] if m.startswith("user:")} for name in plan]
    assert not (texts[0] & texts[1] or texts[0] & texts[2] or texts[1] & texts[2])


def test_answer_estimate_benchmark_compares_every_key_at_equal_standing(tmp_path: Path) -> None:
    out = tmp_path / "answer.json"
    run_benchmark("answer_estimate", ["--models", "smollm2", "--json", str(out)])
    rows = json.loads(out.read_text())["models"]["smollm2"]["rows"]
    assert rows and {row["rule"] for row in rows} == {
        "KV estimate (today)",
        "answer estimate",
        "true KV error",
        "true KL",
    }
    for eps in {row["epsilon"] for row in rows}:
        at = {row["rule"]: row for row in rows if row["epsilon"] == eps}
        assert len({row["standing"] for row in at.values()}) == 1  # as many ops picked by each key
        assert at["true KL"]["kl_mean"] <= min(row["kl_mean"] for row in at.values())


def test_the_replay_frontier_records_each_budgets_answers_and_work_beside_the_prefix_server(
    tmp_path: Path,
) -> None:
    """On SmolLM2, the first step of latest-8 (one new screen: all exact, at any budget): each
    budget's tokens, first token and KL against the prefix server's, and what its budget spent."""
    from tests.real_env import ensure_real_models

    ensure_real_models()
    from kamera_agent.models.real import real_model_gguf

    out = tmp_path / "frontier.json"
    model = str(real_model_gguf("smollm2"))
    args = ["--model", model, "--policies", "latest-8", "--steps", "1", "--budgets", "defaults", "none"]
    run_benchmark("replay_frontier", [*args, "--json", str(out)])
    report = json.loads(out.read_text())
    records = report["records"]
    assert [(r["step"], r["budget"]) for r in records] == [(0, "defaults"), (0, "none")]
    assert all(r["prefilled"] == r["prefix_prefilled"] and r["agrees"] and r["kl"] < 1e-6 for r in records)
    assert all({"audits", "drift_fixes", "edits.admit"} <= r["budget_work"].keys() for r in records)
    assert all(r["largest"] == 0 for r in records)  # every chunk exact: nothing estimated over 0
    assert all(r["audited"] == [] for r in records)  # and nothing audited
    assert report["command"].startswith("python benchmarks/replay_frontier.py --model")
