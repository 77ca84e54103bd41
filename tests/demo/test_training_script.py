"""The retraining command in the model card still runs: a few steps through the whole recipe.

Scaffold, hand-over, the auxiliary loss's fade, plain model, checkpoint and resume, and a saved
folder that loads offline as an ordinary Qwen2-VL (no scaffold weights in it). Training to the
card's figures takes about an hour and is not run here.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import Qwen2VLForConditionalGeneration

from kamera_agent.demo import load_demo_model

SCRIPT = Path(__file__).resolve().parents[2] / "training" / "train_demo_model.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_handover_waits_for_binding_then_moves_linearly(script: ModuleType) -> None:
    handover = script.Handover(steps=4, ready=0.9, patience=100)
    unbound = [{"binding": 0.2}] * 50
    assert handover.share(10, unbound) == 1.0 and handover.began is None
    bound = [{"binding": 0.95}] * 50
    assert [handover.share(step, bound) for step in (20, 21, 22, 24, 30)] == [1.0, 0.75, 0.5, 0.0, 0.0]
    late = script.Handover(steps=2, patience=5)
    assert late.share(4, unbound) == 1.0 and late.share(5, unbound) == 1.0 and late.share(6, unbound) == 0.5


def test_a_short_run_saves_a_plain_model_and_resumes(script: ModuleType, tmp_path: Path) -> None:
    out, checkpoint = tmp_path / "model", tmp_path / "ckpt.pt"
    common = ["--threads", "1", "--batch", "2", "--eval-every", "2", "--out", str(out)]
    common += ["--checkpoint", str(checkpoint), "--handover-after", "1", "--handover-steps", "2"]
    script.main([*common, "--steps", "3"])
    assert torch.load(checkpoint, weights_only=False)["step"] == 3
    script.main([*common, "--steps", "4", "--resume"])
    summary = json.loads((out / "training_log.json").read_text())["summary"]
    assert summary["steps"] == 4 and summary["handover_began"] == 1
    exported = tmp_path / "step-4"
    script.main(["--threads", "1", "--checkpoint", str(checkpoint), "--out", str(exported), "--export"])
    for name in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json"):
        assert (exported / name).read_bytes() == (out / name).read_bytes(), name  # the same plain model
    model, tokenizer, image_processor = load_demo_model(out)
    fresh = script.build(0)[0]
    assert set(model.state_dict()) == set(fresh.state_dict())  # the scaffold is not saved
    assert tokenizer.decode(tokenizer("Absent colour?")["input_ids"]) == "Absent colour?"
    assert image_processor.size["longest_edge"] == 224 * 336


def test_the_auxiliary_loss_fades_to_zero_before_training_ends(script: ModuleType) -> None:
    weights = [script.anneal(step, 100, 0.6, 0.8) for step in (0, 60, 70, 80, 90, 100)]
    assert weights == [1.0, 1.0, pytest.approx(0.5), 0.0, 0.0, 0.0]


def test_a_quarter_of_training_items_are_sparse_controls(script: ModuleType) -> None:
    items = script.training_items(random.Random(0), 400)
    assert 0.18 < sum(item.sparse for item in items) / 400 < 0.32
    assert {item.kind for item in items} == {"colour", "glyph"}
    warming = script.training_items(random.Random(0), 100, warming=True)
    assert {sum(item.glyph_counts.values()) for item in warming} == set(script.WARMING_GLYPHS)


@pytest.mark.parametrize("lookup", [0, 2, 3])  # the first layer, the shipped recipe's, above it
def test_the_lookup_layer_starts_as_an_identity_and_the_layers_below_quiet(
    script: ModuleType, lookup: int
) -> None:
    model = script.build(0, lookup)[0]
    torch.manual_seed(0)
    plain = Qwen2VLForConditionalGeneration(script.demo_config()).model.language_model.layers  # no seeding
    layers = model.model.language_model.layers
    eye = torch.eye(layers[0].self_attn.q_proj.weight.shape[1])
    seeded = layers[lookup].self_attn
    assert torch.equal(seeded.q_proj.weight, eye) and torch.equal(seeded.k_proj.weight, eye)
    assert torch.equal(seeded.o_proj.weight, 0.02 * eye)
    assert torch.equal(layers[-2].self_attn.v_proj.weight, eye)
    assert torch.equal(layers[-2].self_attn.o_proj.weight, 0.3 * eye)
    for index in range(lookup):
        below, default = layers[index], plain[index]
        assert torch.allclose(below.self_attn.o_proj.weight, 0.1 * default.self_attn.o_proj.weight)
        assert torch.allclose(below.mlp.down_proj.weight, 0.1 * default.mlp.down_proj.weight)
        assert torch.equal(below.self_attn.q_proj.weight, default.self_attn.q_proj.weight)
    above = layers[lookup + 1].self_attn
    assert not torch.equal(above.q_proj.weight, eye)  # the rest is the default init


def test_frame_tokens_name_their_glyph_for_the_auxiliary_loss(script: ModuleType) -> None:
    _, backend = script.build(0)
    cache = script.FrameCache(backend.encoder)
    item = script.make_item(random.Random(3), "glyph")
    batch = script.collate(backend, [script.item_sequence(cache, item)])
    names = batch["glyph_targets"][0]
    named = names[names != -100].tolist()
    shown = [g for page in item.pages for g in page if g != script.BLANK]
    legend = [g for frame in item.legend for g, _ in frame]
    assert named == [script._first_token(backend, g) for g in [*legend, *shown]]  # filler is not named
    assert set(named).isdisjoint(script._first_token(backend, c) for c in script.COLOURS)
