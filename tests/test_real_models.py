"""The two real checkpoints through every entry point that names a model: SmolLM2-135M-Instruct
(Llama architecture, GQA, its own ChatML template) and Gemma 3 270M (a base model; sliding-window
layers of 512 tokens beside global ones, two rotary bases), each by its GGUF file as the index
ships it and by the folder that file converts to.

The packages come with the README's test command (``scripts/bootstrap.sh``); the first use on a
machine converts each file once into kamera's cache (tens of seconds), later ones load in a
fraction of one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from kamera_agent import KameraWindow, WindowConfig
from kamera_agent.checkpoints import load_model, resolve_checkpoint
from kamera_agent.cli import main
from kamera_agent.demo.model import DEMO_MODEL_DIR, load_demo_model
from kamera_agent.errors import UncalibratedWarning
from kamera_agent.fingerprint import checkpoint_fingerprint
from kamera_agent.loading import load_backend
from kamera_agent.models.real import REAL_MODELS, RealModel, real_model_gguf
from tests.real_env import ensure_real_models
from tests.window.helpers import answer_gap, chunk_errors

GEMMA_TURNS = Path(__file__).parents[1] / "examples" / "chat_templates" / "gemma3-turns.jinja"
"""The template the docs give Gemma 3 270M (a base model, none of its own) for conversations."""
PROSE = (
    "The river rose through the night and by morning the lower fields were under water. ",
    "Farmers moved their animals to the hill above the church, where the ground stayed dry. ",
    "In the afternoon the rain stopped and the sun came out over the flooded valley. ",
    "Children waded along the old road, looking for fish trapped in the shallow pools. ",
)


@pytest.fixture(scope="module")
def files() -> dict[RealModel, Path]:
    ensure_real_models()
    return {name: real_model_gguf(name) for name in REAL_MODELS}


@pytest.mark.parametrize("name", REAL_MODELS)
def test_one_fingerprint_by_gguf_file_folder_and_loaded_model(
    files: dict[RealModel, Path], name: RealModel
) -> None:
    folder = resolve_checkpoint(files[name]).folder
    by_file = load_backend(files[name]).fingerprint
    by_folder = load_backend(folder).fingerprint
    by_object = load_backend(load_model(folder)).fingerprint  # its tokenizer found where it came from
    assert by_file == by_folder == by_object == checkpoint_fingerprint(files[name])


def test_a_model_transformers_read_from_gguf_is_the_same_model(files: dict[RealModel, Path]) -> None:
    from transformers import AutoModelForCausalLM

    path = files["smollm2"]
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    backend = load_backend(loaded)  # no tokenizer passed: found from the GGUF file it was read from
    assert backend.fingerprint == checkpoint_fingerprint(path)
    assert backend.encoder.tokens("hello world").tolist() == backend.tokenizer("hello world")["input_ids"]


def test_the_demo_model_by_folder_finds_its_shipped_calibration() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncalibratedWarning)
        by_folder = KameraWindow(DEMO_MODEL_DIR)
    model, tokenizer, image_processor = load_demo_model()
    by_object = KameraWindow(model, tokenizer=tokenizer, image_processor=image_processor)
    assert by_folder.backend.fingerprint == by_object.backend.fingerprint
    assert by_folder.budget is not None and by_folder.budget == by_object.budget


@pytest.mark.parametrize(("name", "form"), [("smollm2", "gguf"), ("gemma3", "gguf"), ("smollm2", "folder")])
def test_kamera_check_passes(
    files: dict[RealModel, Path], name: RealModel, form: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = files[name] if form == "gguf" else resolve_checkpoint(files[name]).folder
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 3 and "all checks passed" in out
    if name == "gemma3":
        assert "a rotary base per layer" in out and "sliding window 512" in out


def test_an_exact_window_on_gemma3_reaches_past_its_sliding_window(files: dict[RealModel, Path]) -> None:
    window = KameraWindow(str(files["gemma3"]), config=WindowConfig.exact(capacity_chunks=6))
    refs = [window.push(text * 10) for text in PROSE]  # ~ 4 x 170 tokens: past the 512-token window
    assert sum(window.chunk(ref).num_tokens for ref in window.refs) > 512
    window.reorder([refs[2], refs[0], refs[3], refs[1]])
    window.slide(1)
    window.push(PROSE[0])
    assert max(chunk_errors(window).values()) <= 2e-5
    kl, gap = answer_gap(window, "Where did the farmers go?")
    assert kl < 1e-9 and gap <= 1e-4, (kl, gap)


def test_kamera_calibrate_takes_a_gguf_file(files: dict[RealModel, Path], tmp_path: Path) -> None:
    args = ["calibrate", str(files["smollm2"]), "--ops", "10", "--seeds", "5", "--out", str(tmp_path)]
    assert main(args) == 0
    (filed,) = tmp_path.glob("*.json")
    assert json.loads(filed.read_text())["fingerprint"] == checkpoint_fingerprint(files["smollm2"])


def test_kamera_bench_takes_a_gguf_file(files: dict[RealModel, Path], tmp_path: Path) -> None:
    args = ["bench", "--suite", "window", "--model", str(files["smollm2"]), "--quick", "--ops", "4"]
    assert main([*args, "--rows", "defaults", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    (run,) = results["suites"]["window"]["runs"]
    assert run["ops_done"] == 4
    # a text model's image suites are refused by name, before anything runs
    assert (
        main(["bench", "--suite", "fidelity", "--model", str(files["smollm2"]), "--out", str(tmp_path)]) == 2
    )


def test_kamera_serve_answers_a_conversation_on_smollm2_like_a_fresh_prefill(
    files: dict[RealModel, Path], tmp_path: Path
) -> None:
    """``kamera serve`` on the GGUF file, SmolLM2's own chat template unmodified (it takes string
    content only): each turn's greedy answer is ``generate``'s over the whole conversation."""
    backend = load_backend(files["smollm2"])
    with _Serving(tmp_path, str(files["smollm2"])) as client:
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You answer in one short sentence."}]
        for question in (
            "Where do rivers flood?",
            "Why do farmers move animals uphill?",
            "What dries a field?",
        ):
            messages.append({"role": "user", "content": question})
            response = client.chat.completions.create(
                model="SmolLM2-135M-Instruct.Q4_1",
                messages=messages,  # type: ignore[arg-type]
                temperature=0,
                max_tokens=10,
            )
            answer = response.choices[0].message.content or ""
            assert answer == _generated(backend, messages, 10)
            assert response.usage is not None
            messages.append({"role": "assistant", "content": answer})


def test_kamera_serve_gives_a_base_model_the_template_it_is_passed(files: dict[RealModel, Path]) -> None:
    """Gemma 3 270M is a base model without a chat template: serve refuses it by name, and serves
    it with ``--chat-template``."""
    from kamera_agent.serve.command import build_server
    from tests.serve.conftest import LiveServer

    folder = str(resolve_checkpoint(files["gemma3"]).folder)
    assert main(["serve", folder]) == 2  # refused before listening: no chat template
    args = _serve_args(folder, chat_template=str(GEMMA_TURNS))
    live = LiveServer(build_server(args))
    try:
        response = live.client.chat.completions.create(
            model=args.model_name or Path(folder).name,
            messages=[{"role": "user", "content": PROSE[0]}],
            temperature=0,
            max_tokens=4,
        )
        assert response.usage is not None and response.usage.prompt_tokens > 20
    finally:
        live.stop()


def test_kamera_bench_replays_a_base_model_framed_by_the_template_it_is_passed(
    files: dict[RealModel, Path],
) -> None:
    """agents-replay drives kamera serve, so it takes ``--chat-template`` as serve does: Gemma 3's
    backend gets the shipped example template, whose turns frame themselves as a conversation
    window needs."""
    import argparse

    from kamera_agent.chunks.chat import ChatTemplate
    from kamera_agent.parsers.bench import add_bench_parser
    from kamera_agent.replay.command import replay_models

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    argv = ["bench", "--suite", "agents-replay", "--model", str(files["gemma3"]), "--quick"]
    args = parser.parse_args([*argv, "--chat-template", str(GEMMA_TURNS)])
    backends, screens = replay_models(args)
    (backend,) = backends.values()
    assert backend.tokenizer.chat_template == GEMMA_TURNS.read_text() and list(screens) == list(backends)
    template = ChatTemplate.from_tokenizer(backend.tokenizer, backend.encoder.prompt)
    assert (
        template.opens["user"] == "<start_of_turn>user\n" and template.generation == "<start_of_turn>model\n"
    )
    assert template.closes["assistant"] == "<end_of_turn>\n"


def _serve_args(model: str, **overrides: Any) -> Any:
    import argparse

    from kamera_agent.serve.command import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", model])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def _generated(backend: Any, messages: list[dict[str, Any]], tokens: int) -> str:
    inputs = backend.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = backend.model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    text: str = backend.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return text


class _Serving:
    """``kamera serve MODEL`` as a process of its own on a free loopback port; the official client."""

    def __init__(self, tmp_path: Path, model: str) -> None:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.log_path = tmp_path / "serve.log"
        self.command = [sys.executable, "-m", "kamera_agent", "serve", model, "--port", str(self.port)]

    def __enter__(self) -> openai.OpenAI:
        self.log = self.log_path.open("wb")
        env = {**os.environ, "KAMERA_NUM_THREADS": "1"}
        self.process = subprocess.Popen(self.command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).close()
                break
            except OSError:
                alive = self.process.poll() is None and time.monotonic() < deadline
                assert alive, self.log_path.read_text()
                time.sleep(0.3)
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0)

    def __exit__(self, *exc: object) -> None:
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=30)
        self.log.close()
