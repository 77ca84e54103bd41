"""``kamera bench --suite agents --model TEXT_MODEL``: the agents on a text model, over real text.

Why a tiny random Llama (SmolLM2's architecture) with the byte tokenizer: the suite's mechanics
(a text model is run rather than refused, every agent on every side, every step checked against
the model's own re-prefill, the by-kind records) do not depend on trained weights, and exactness
does not either: `WindowConfig.exact` must answer like a re-prefill on any weights. The lengths
the text agents push are checked on SmolLM2's own tokenizer where it is installed (no forward
runs), and on the byte tokenizer, whose count is the characters, everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kamera_agent.bench import runner
from kamera_agent.bench.agents.a11y import screen_title
from kamera_agent.bench.agents.records import RECOMPUTE_SIDES, TEXT_SIDES, UNBOUNDED
from kamera_agent.bench.agents.script import Script
from kamera_agent.bench.agents.scripts import AGENTS, AgentCounts
from kamera_agent.bench.agents.text_contents import (
    QUICK_TEXT_LENGTHS,
    TEXT_LENGTHS,
    TextContents,
    fit,
)
from kamera_agent.bench.common import AGENT_NAMES, BenchOptions
from kamera_agent.bench.corpus import _half
from kamera_agent.chunks.encoder import ChunkEncoder
from tests.backends.test_transformers_backend import sharpen
from tests.tiny_models import tiny_llama
from tests.tiny_processors import tiny_tokenizer


@pytest.fixture(scope="module")
def agents(tiny_text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick agents run on the text model through the bench runner."""
    out = tmp_path_factory.mktemp("agents-text")
    options = BenchOptions(suite="agents", quick=True, model=tiny_text_model_dir, out=out)
    outcome = runner.run_bench(options, Console(width=200, record=True))
    assert outcome.exit_code == 0
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    return {"suite": results["suites"]["agents"], "report": (out / "report.md").read_text()}


def test_a_text_model_runs_every_agent_on_itself_over_real_text(agents: dict[str, Any]) -> None:
    suite, name = agents["suite"], None
    assert suite["realistic_shape"] is None and suite["ttft"] is None  # no random-weight stand-in
    assert suite["text_lengths"] == {kind: list(span) for kind, span in QUICK_TEXT_LENGTHS.items()}
    for run in suite["runs"]:
        name = name or run["model"]
        assert run["model"] == name and name.startswith("tiny-llama-text")
        assert set(run["sides"]) == set(TEXT_SIDES)
        assert run["steps_done"] == run["steps_requested"] == len(run["records"]) == len(run["checks"])
        assert {check["reference"] for check in run["checks"]} == {"re-prefill"}
        assert run["baseline_max_error"] < 1e-4  # the prefix cache is the model's own forward
        for kind, sizes in run["tokens_per_chunk"].items():  # "40" or "33-62"
            lo, hi = QUICK_TEXT_LENGTHS[kind]
            assert all(lo <= int(n) <= hi for n in sizes.split("-")), (run["agent"], kind, sizes)
    assert [run["agent"] for run in suite["runs"]] == list(AGENT_NAMES)
    assert "## Agents: by step kind" in agents["report"]


def test_each_sides_tokens_are_what_its_ops_prefilled(agents: dict[str, Any]) -> None:
    for run in agents["suite"]["runs"]:
        for side in TEXT_SIDES:
            per_op = sum(op["tokens"] for record in run["records"] for op in record["ops"][side])
            per_step = sum(record["sides"][side]["tokens"] for record in run["records"])
            by_kind = sum(entry["tokens"] for entry in run["sides"][side]["by_kind"].values())
            by_op = sum(run["sides"][side]["totals"]["by_op_tokens"].values())
            assert per_op == per_step == by_kind == by_op == run["sides"][side]["totals"]["tokens"] > 0


@pytest.fixture(scope="module")
def scripts(tiny_text_model_dir: Path) -> dict[str, Any]:
    """The scripts the quick run ran, rebuilt from the same contents (no forward), and the
    anchor's tokens."""
    from kamera_agent.loading import load_backend

    backend = load_backend(tiny_text_model_dir)
    contents = TextContents(backend.encoder, QUICK_TEXT_LENGTHS, BenchOptions().seeds["agents"])
    return {
        "anchor": backend.anchor.num_tokens,
        **{agent: AGENTS[agent](contents, AgentCounts.quick()) for agent in AGENT_NAMES},
    }


def test_the_prefix_cache_prefills_every_token_from_the_first_change(
    agents: dict[str, Any], scripts: dict[str, Any]
) -> None:
    """Its cost is known without running it: each step it prefills the lineup from the first
    chunk that differs from the last step's (the anchor before the first step)."""
    for run in agents["suite"]["runs"]:
        script: Script = scripts[run["agent"]]
        assert [step.kind for step in script.steps] == [record["kind"] for record in run["records"]]
        before: tuple[str, ...] = ()
        for step, record in zip(script.steps, run["records"], strict=True):
            first = next(
                (i for i, (a, b) in enumerate(zip(before, step.lineup, strict=False)) if a != b),
                min(len(before), len(step.lineup)),
            )
            expected = sum(script.chunks[label].num_tokens for label in step.lineup[first:])
            expected += scripts["anchor"] if not before else 0
            sync = next(op for op in record["ops"]["prefix"] if op["op"] == "sync")
            assert sync["tokens"] == expected, (run["agent"], record["index"])
            assert record["window_tokens"] == sum(script.chunks[label].num_tokens for label in step.lineup)
            before = step.lineup


def test_the_unbounded_side_runs_the_defaults_policies_with_no_budget(agents: dict[str, Any]) -> None:
    """No audits and no fixes (none of its ops is counted as one), every step still checked
    against re-prefill."""
    for run in agents["suite"]["runs"]:
        settings = {side: run["sides"][side]["settings"] for side in (UNBOUNDED, "kamera")}
        assert settings[UNBOUNDED]["drift_budget"] is None
        assert settings[UNBOUNDED]["survivors"] == settings["kamera"]["survivors"]
        checked = run["sides"][UNBOUNDED]["fidelity"]
        assert checked["agreement"] is not None and len(run["checks"]) == run["steps_done"]


def test_token_recompute_sides_run_at_their_shares_and_are_checked_like_the_others(
    agents: dict[str, Any],
) -> None:
    """Each recompute side records its share, is checked after every step against re-prefill,
    and, reusing canonicals behind changed context, measurably differs from it somewhere."""
    for run in agents["suite"]["runs"]:
        for side, fraction in RECOMPUTE_SIDES.items():
            assert run["sides"][side]["settings"]["fraction"] == fraction
            assert run["sides"][side]["fidelity"]["agreement"] is not None
    worst = max(run["sides"]["recompute 5%"]["fidelity"]["kl_max"] for run in agents["suite"]["runs"])
    assert worst > 1e-6


def test_exact_settings_answer_like_re_prefill_after_every_step(agents: dict[str, Any]) -> None:
    for run in agents["suite"]["runs"]:
        fidelity = run["sides"]["kamera-exact"]["fidelity"]
        assert fidelity["agreement"] == 1.0 and fidelity["kl_max"] < 1e-6, run["agent"]
        kinds = run["sides"]["kamera-exact"]["by_kind"]
        assert {record["kind"] for record in run["records"]} == set(kinds)
        assert sum(entry["checks"] for entry in kinds.values()) == len(run["checks"])
        assert all(entry["agreement"] == 1.0 for entry in kinds.values())


def test_a_push_only_stream_prefills_each_chunk_once_and_each_question_alone(
    agents: dict[str, Any], scripts: dict[str, Any], tiny_text_model_dir: Path
) -> None:
    """Counted without the window: the anchor and every chunk once on every window side and the
    prefix cache, and each question's own tokens at every ask (exact settings and the prefix
    cache). Token recompute pays each chunk's canonical and then a share of it again behind
    what precedes it: more than pushing it, less than twice."""
    from kamera_agent.loading import load_backend

    encoder = load_backend(tiny_text_model_dir).encoder
    stream = next(run for run in agents["suite"]["runs"] if run["agent"] == "stream")
    script: Script = scripts["stream"]
    pushed = scripts["anchor"] + sum(chunk.num_tokens for chunk in script.chunks.values())
    for side in TEXT_SIDES:
        window = sum(
            op["tokens"] for record in stream["records"] for op in record["ops"][side] if op["op"] != "ask"
        )
        if side in RECOMPUTE_SIDES:
            assert pushed < window < 2 * pushed, side
        else:
            assert window == pushed, side
    for run in agents["suite"]["runs"]:
        asks = [step.ask for step in scripts[run["agent"]].steps]
        for record, query in zip(run["records"], asks, strict=True):
            for side in ("kamera-exact", "prefix"):
                spent = [op["tokens"] for op in record["ops"][side] if op["op"] == "ask"]
                assert spent == ([] if query is None else [len(query.ids(encoder))]), (
                    run["agent"],
                    side,
                )


# -- the text agents' contents, without a forward -------------------------------------------------


def _encoder(tokenizer: Any) -> ChunkEncoder:
    from kamera_agent.backends.transformers import TransformersBackend

    return TransformersBackend(sharpen(tiny_llama()), tokenizer=tokenizer).encoder


@pytest.mark.parametrize("lengths", [QUICK_TEXT_LENGTHS, TEXT_LENGTHS], ids=["quick", "agents"])
def test_every_chunk_kind_is_pushed_at_its_lengths(lengths: Any) -> None:
    contents = TextContents(_encoder(tiny_tokenizer()), lengths, 11)
    for kind, (lo, hi) in lengths.items():
        sizes = [contents.make(kind, index).num_tokens for index in range(6)]
        assert all(lo <= n <= hi for n in sizes), (kind, sizes)
        assert len(set(sizes)) > 1, kind  # drawn per chunk, not one size for all


def test_smollm2s_text_agents_have_agents_lengths_in_its_own_tokens() -> None:
    from transformers import AutoTokenizer

    from kamera_agent.checkpoints import resolve_checkpoint
    from kamera_agent.errors import CheckpointError
    from kamera_agent.models.real import real_model_gguf

    try:
        gguf = real_model_gguf("smollm2")
    except CheckpointError as exc:  # found, not imported: its package imports llama.cpp's runtime
        pytest.skip(str(exc))
    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(gguf).folder)
    contents = TextContents(_encoder(tokenizer), TEXT_LENGTHS, 5)
    expected = {"screenshot": (300, 800), "frame": (300, 800), "item": (200, 2000), "page": (500, 1000)}
    for kind, (lo, hi) in expected.items():
        sizes = [contents.make(kind, index).num_tokens for index in range(4)]
        assert all(lo <= n <= hi for n in sizes), (kind, sizes)


def test_screens_are_accessibility_trees_and_pages_are_the_corpus_benchmark_half() -> None:
    encoder = _encoder(tiny_tokenizer())
    contents = TextContents(encoder, TEXT_LENGTHS, 3)
    screen = encoder.tokenizer.decode(contents.make("screenshot", 2).input_ids)
    assert screen.startswith(screen_title(3, 2)) and "  banner\n" in screen and 'link "' in screen
    again = TextContents(encoder, TEXT_LENGTHS, 3).make("screenshot", 2)
    assert screen == encoder.tokenizer.decode(again.input_ids)  # the same seed, the same screen
    page = encoder.tokenizer.decode(contents.make("page", 0).input_ids)
    first = page.split("\n\n")[0]
    assert any(passage.startswith(first) for passage in _half("benchmark"))
    assert not any(passage.startswith(first) for passage in _half("calibration"))


def test_fit_reaches_its_target_and_never_passes_its_top() -> None:
    count = len  # a character a token
    assert fit(["aaaa", "bbbb", "cccc"], " ", 6, 20, count) == "aaaa bbbb"
    assert fit(["aaaa bbbb cccc"], " ", 6, 10, count) == "aaaa bbbb"  # cut at a word
    assert fit(["a" * 30], " ", 6, 10, count) == "a" * 10  # one word past the top: cut within it


def test_gemma3s_sliding_window_layers_run_the_text_agents_exactly() -> None:
    """Gemma 3's architecture (sliding-window layers beside global ones, two rotary bases), tiny:
    the exact side answers like the model's own re-prefill after every step of every agent."""
    from kamera_agent.bench.agents.run import new_run, run_text_suite
    from kamera_agent.bench.progress import make_progress
    from tests.backends.test_transformers_backend import text_backend

    run = new_run(True, AGENT_NAMES, "tiny-gemma3", text=True)
    with make_progress(Console(quiet=True)) as progress:
        run_text_suite(run, text_backend("gemma3", layers=4), 5, progress)
    assert [record.agent for record in run.runs] == list(AGENT_NAMES)
    for record in run.runs:
        assert record.complete and len(record.checks) == record.steps_requested
        assert record.agreement("kamera-exact") == 1.0, record.agent
        assert max(check.kl["kamera-exact"] for check in record.checks) < 1e-6, record.agent
        assert record.max_baseline_error() < 1e-4, record.agent


def test_an_agent_whose_window_passes_the_models_context_is_refused_before_it_runs() -> None:
    from kamera_agent.backends.transformers import TransformersBackend
    from kamera_agent.bench.agents.run import new_run, run_text_suite
    from kamera_agent.bench.progress import make_progress
    from kamera_agent.errors import SettingsError

    backend = TransformersBackend(
        sharpen(tiny_llama(max_position_embeddings=256)), tokenizer=tiny_tokenizer()
    )
    assert backend.context_limit == 256
    run = new_run(True, ("stream",), "tiny", text=True)
    with make_progress(Console(quiet=True)) as progress, pytest.raises(SettingsError, match="context of 256"):
        run_text_suite(run, backend, 5, progress)
    assert run.runs == []  # refused before its first step


def test_a_text_model_is_refused_only_where_the_demo_tasks_images_are_needed(
    tiny_text_model_dir: Path, tmp_path: Path
) -> None:
    console = Console(width=200, record=True)
    options = BenchOptions(suite="fidelity", model=tiny_text_model_dir, out=tmp_path / "out")
    assert runner.run_bench(options, console).exit_code == runner.USAGE_ERROR
    assert "run --suite window or agents" in console.export_text()
    assert not (tmp_path / "out").exists()
