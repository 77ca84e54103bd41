"""The examples run end to end on CPU, and their loops do what their docstrings say.

Each example's ``main()`` runs on the shipped demo model when its weights are present, else on
an untrained stand-in of the same architecture (built once per session): answers are not
checked, the mechanics and costs are (recall without a vision encode, a store hit with zero
forwards, reorder putting the best page first, a probe before every eviction).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kamera_agent.demo.model import DEMO_MODEL_DIR

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="session")
def model_args(untrained_demo_dir: Path) -> list[str]:
    """``[]`` (the shipped demo model) or ``["--model", DIR]`` with an untrained stand-in.

    The stand-in is built from the demo's own config, tokenizer and image processor rather than
    by `training/train_demo_model.py`, whose shortest run (one step plus its held-out eval)
    takes 40-70 s on this machine's CPUs.
    """
    if (DEMO_MODEL_DIR / "config.json").is_file():
        return ["--threads", "1"]
    return ["--threads", "1", "--model", str(untrained_demo_dir)]


def load_example(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import ``examples/<name>.py`` by path (examples/ is not a package; it imports _shared)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["video_agent", "web_agent", "document_agent"])
def test_help_describes_the_loop(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        load_example(name, monkeypatch).main(["--help"])
    assert exited.value.code == 0
    assert "--model" in capsys.readouterr().out


def test_video_agent_recalls_a_slid_out_frame_without_vision(
    model_args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    video = load_example("video_agent", monkeypatch)
    run = video.main(
        [*model_args, "--frames", "5", "--capacity", "3", "--back", "1", "--max-new-tokens", "2"]
    )
    rows = run.log.rows
    pushes = [row for row in rows if row.op == "push"]
    asks = [row for row in rows if row.op == "ask"]
    assert len(pushes) == len(asks) == len(run.answers) == 5
    assert all(row.cost.vision_encodes == 1 for row in pushes)  # each frame encoded once
    assert [row.what for row in pushes[3:]] == ["#4, #1 out", "#5, #3 out"]  # the window slid
    # frame #1 slid out at step 4, the question at step 4 refers back to it: recalled, not re-encoded
    assert run.answers[3][0] == "Which glyph is in frame #1?"
    (recall,) = [row for row in rows if row.op == "recall"]
    assert (recall.step, recall.what, recall.cost.vision_encodes) == (4, "#1", 0)
    # the dry run predicted the plan's cost; the drift budget's audits (and any fix) come after it
    predicted, cost = run.recalls["#1"].forwards, recall.cost
    assert cost.forwards == predicted if not cost.audits else cost.forwards >= predicted + cost.audits
    assert all(edit.forwards == 0 for edit in run.recalls["#1"].edits if edit.label == "#1")
    assert all(row.cost.vision_encodes == 0 and row.cost.tokens_prefilled < row.reprefill for row in asks)
    out = capsys.readouterr().out
    assert "video agent: window of 3 frames" in out and "recall #1:" in out


def test_web_agent_grounder_push_is_a_store_hit_and_back_recalls(
    model_args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    web = load_example("web_agent", monkeypatch)
    run = web.main([*model_args, "--size", "56", "--max-new-tokens", "2"])
    rows = run.log.rows
    planner = [row for row in rows if row.op == "push" and row.what.startswith("planner")]
    grounder = [row for row in rows if row.op == "push" and row.what.startswith("grounder")]
    assert len(planner) == len(grounder) == len(web.TRAJECTORY) - 1
    assert all(row.cost.vision_encodes == 1 for row in planner)  # each screenshot encoded once ...
    for row in grounder:  # ... and the grounder's push of the same screenshot is a store hit
        assert (row.cost.forwards, row.cost.vision_encodes, row.cost.tokens_prefilled) == (0, 0, 0)
    recalls = [row for row in rows if row.op == "recall"]
    assert [row.what for row in recalls] == ["planner: results", "grounder: results"]
    assert all(row.cost.vision_encodes == 0 and row.cost.tokens_prefilled < row.reprefill for row in recalls)
    asks = [(role, prompt) for role, prompt, _ in run.answers]
    assert len(asks) == 2 * len(web.TRAJECTORY) and asks[0][1] != asks[1][1]  # two prompts per page
    assert "planner and grounder" in capsys.readouterr().out


@pytest.mark.parametrize("threshold", [0.0, 1e-2, 1e9])
def test_document_agent_reorders_best_first_and_evicts_only_disposable_pages(
    threshold: float, model_args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    document = load_example("document_agent", monkeypatch)
    args = [*model_args, "--pages", "4", "--size", "56", "--max-new-tokens", "2"]
    run = document.main([*args, "--threshold", str(threshold)])
    assert run.scores == {"Kettle manual": 1, "Filling": 0, "Boiling": 1, "Descaling": 3}
    assert run.order == ["Descaling", "Kettle manual", "Boiling", "Filling"]  # best first, ties stable
    (reorder,) = [row for row in run.log.rows if row.op == "reorder"]
    assert reorder.cost.vision_encodes == 0 and reorder.cost.tokens_prefilled < reorder.reprefill
    assert list(run.probes) == ["Filling", "Boiling", "Kettle manual"]  # every page but the best, worst first
    assert run.evicted == [label for label, probe in run.probes.items() if probe.disposable]
    assert all(probe.cost.vision_encodes == 0 for probe in run.probes.values())
    if threshold == 0.0:
        assert run.evicted == []
    if threshold == 1e9:
        assert run.evicted == ["Filling", "Boiling", "Kettle manual"]
    assert set(run.answers) == {document.COARSE, document.FINE}


def test_openai_agent_is_served_from_reuse(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The official client against a live ``kamera serve`` (started by the example): from the
    second step on part of every prompt is cached, and once the oldest exchange is dropped the
    request evicts it and prefills only the new message and the question."""
    agent = load_example("openai_agent", monkeypatch)
    usages = agent.main(["--steps", "5"])
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    out = capsys.readouterr().out
    before, after = out.split("step 4:")
    assert "evict" not in before and "evict" in after
