"""The ``kamera`` command: ``check`` on checkpoints the tests save, ``demo`` on the shipped model,
help and version without torch, and every refusal in one line."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kamera_agent.check import run_check
from kamera_agent.cli import build_parser, main
from tests.tiny_processors import save_tiny_text, save_tiny_vl, tiny_tokenizer


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_check_passes_on_a_vl_checkpoint(
    tmp_path: Path, family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    save_tiny_vl(tmp_path, family)
    assert main(["check", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 3 and "all checks passed" in out


def test_check_reports_each_measured_figure_on_a_text_checkpoint(tmp_path: Path) -> None:
    save_tiny_text(tmp_path, "llama")
    report = run_check(tmp_path)
    assert [v.name for v in report.verdicts] == ["relocation", "full-rank patch", "window vs generate"]
    assert report.passed
    assert 0 < report.verdicts[0].measured < 2e-5  # measured, not a constant


def test_operator_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--operator"]) == 0
    assert "Patch rank vs next-token KL" in capsys.readouterr().out


@pytest.fixture(scope="module")
def untrained_demo_model(untrained_demo_dir: Path) -> Path:
    return untrained_demo_dir


def test_demo_episode_runs_every_window_op(
    untrained_demo_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--model", str(untrained_demo_model)]) == 0
    out = capsys.readouterr().out
    for op in ("push legend", "push page", "reorder legend", "probe_without", "evict #1", "recall #1"):
        assert op in out


def test_demo_without_weights_falls_back_to_the_operator_demo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import kamera_agent.demo.model as demo_model

    monkeypatch.setattr(demo_model, "DEMO_MODEL_DIR", tmp_path / "missing")
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "weights are missing" in out and "Patch rank vs next-token KL" in out


def test_episode_recall_runs_no_forward(untrained_demo_model: Path) -> None:
    from kamera_agent.demo.episode import run_demo_episode

    result = run_demo_episode(model_path=untrained_demo_model)
    recall = next(step for step in result.steps if step.op == "recall #1")
    assert recall.cost.forwards == 0 and recall.cost.vision_encodes == 0
    assert recall.prefix_cache_tokens > 0


def test_version_and_every_commands_help_answer_without_importing_torch() -> None:
    """The console script imports the package and the command's parser only: ``kamera --help``
    used to wait ~10 s for torch."""
    commands = ["demo", "check", "bench", "calibrate", "store", "serve"]
    script = (
        "import sys\n"
        "from kamera_agent.cli import main\n"
        f"for argv in [['--version'], ['--help'], *[[c, '--help'] for c in {commands!r}]]:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "kamera 0.1.0" in done.stdout and "an OpenAI-compatible chat server" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "False False", done.stdout[-500:]
    version = subprocess.run(
        [sys.executable, "-m", "kamera_agent", "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.strip() == "kamera 0.1.0"


def test_every_command_has_a_description_and_shows_its_defaults() -> None:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in commands.choices.items():
        assert parser.description, name
        shown = " ".join(parser.format_help().split())
        for action in parser._actions:
            if action.default in (None, False, argparse.SUPPRESS) or not action.help:
                continue
            assert "default" in action.help or f"(default: {action.default})" in shown, (name, action.dest)


def test_the_parsers_offer_what_the_commands_run() -> None:
    """The parsers list their choices without importing the commands: held to the real lists."""
    from kamera_agent.bench import calibrate, calibration_episodes, common, frontier
    from kamera_agent.parsers import bench, model
    from kamera_agent.store import command

    assert tuple(frontier.ROWS) == bench.FRONTIER_ROWS and bench.AGENTS == common.AGENT_NAMES
    assert bench.HELD_OUT_SEED == common.HELD_OUT_SEED and bench.FIT_SEEDS == calibration_episodes.FIT_SEEDS
    assert set(bench.DTYPES) == set(calibrate._DTYPES) and model.STORE_URL_VARIABLE == command._VARIABLE
    assert set(bench.SUITES) == {
        *common.BenchOptions.model_fields["suite"].annotation.__args__,
        "agents-replay",
    }


def _refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line ``kamera argv`` prints as it refuses (exit status 2, no traceback)."""
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out + err, out + err
    return out


def test_every_refusal_at_the_command_line_is_one_line_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # a narrow terminal wraps nothing either
    assert "--config" in _refusal(capsys, "serve", "--config", str(tmp_path / "window.json"))
    (tmp_path / "window.json").write_text("{rank: 3")
    assert "not JSON" in _refusal(capsys, "serve", "--config", str(tmp_path / "window.json"))
    (tmp_path / "window.json").write_text('{"rank": -3}')
    assert "rank" in _refusal(capsys, "serve", "--config", str(tmp_path / "window.json"))
    assert "--api-keys" in _refusal(capsys, "serve", "--api-keys", str(tmp_path / "keys.json"))
    assert "Jinja" in _refusal(capsys, "serve", "--chat-template", "nope.jinja")
    from kamera_agent.serve.command import read_chat_template

    long_template = "{{ bos_token }}" * 100  # longer than a file name may be: read as the template
    assert read_chat_template(long_template) == long_template
    template = ["--chat-template", "{{ messages }}"]  # frames conversations: agents-replay on a model only
    assert "agents-replay" in _refusal(capsys, "bench", "--suite", "window", *template)
    assert "agents-replay" in _refusal(capsys, "bench", "--suite", "agents-replay", *template)
    assert "--passes" in _refusal(capsys, "bench", "--suite", "window", "--passes", "2")
    with monkeypatch.context() as env:
        env.setenv("KAMERA_NUM_THREADS", "many")
        assert "KAMERA_NUM_THREADS" in _refusal(capsys, "store", "stats")
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text('{"model_type": "qwen2"}')
    for command in ("serve", "check", "calibrate"):
        assert "no weights" in _refusal(capsys, command, str(weightless)), command
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512)).save_pretrained(gpt2)
    tiny_tokenizer().save_pretrained(gpt2)
    said = _refusal(capsys, "serve", str(gpt2))  # what docs/models.md says of it
    assert "model type 'gpt2' is not supported" in said and "Family entry" in said
    with pytest.raises(Exception, match="gpt2"):  # --debug: the traceback instead
        main(["serve", str(gpt2), "--debug"])
