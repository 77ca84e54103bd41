"""Train kamera-tiny-vl, the shipped demo model, on the synthetic visual binding task.

    python training/train_demo_model.py --threads 1    # the shipped model's recipe: 2,200 steps

(70 min on one core; ``--until N`` stops at step N and ``--resume`` continues from the last
checkpoint; ``--export`` writes a checkpoint's plain model, to measure a run mid-way).

Plain PyTorch on CPU. Each step trains on a batch of items laid out exactly as a KameraWindow
lays them out (anchor, one chunk per frame, the question), a quarter of them sparse-binding
control items (`kamera_agent.demo.task`), with losses over the full vocabulary:

- the answer tokens;
- an auxiliary loss, **annealed to zero** (`--anneal-from` .. `--anneal-to` of the steps; the
  last stretch of training is the answer loss alone): every glyph token of a page predicts the
  colour its glyph *means*. The page shows the glyph in white, so the colour must come from the
  legend frame that shows the same glyph in colour: the binding is first taught on the pages'
  own tokens (cross-chunk conditioning) rather than only on the query side. Without it a briefly
  trained tiny model answers from the query alone and blind reuse would not hurt it; once the
  model answers through the pages, the answer loss alone keeps it so, and what the fidelity
  suite then measures (the deficit's rank, depth, spread over tokens) is the model's own.
  Legend tokens, under the same weight, predict their own colour (plain readout): it teaches
  the colour readout directly, so with `seed_lookup`'s identity path a page token's lookup pays
  off as soon as it attends to the right entry at all (neither alone formed the lookup in 400
  steps). Every glyph token (legend and page) also names its glyph: with the lookup seeded
  above the first layers (`LOOKUP_LAYER`), the pages' lookup did not form without this term
  (one run: page binding at chance through step 500, 0.84 with it), and the readout question's
  answer (a glyph name) becomes a feature the legend's tokens already hold.

**Scaffold curriculum.** Trained end to end from scratch, this tiny model learns to read the
glyphs within a few hundred steps but did not learn the cross-frame lookup (four runs of up to
3,750 steps on an earlier layout of the task, eight of 200-1,400 steps on another), while the
same decoder learns it in a few hundred steps when a frame token is a learned embedding. So
training starts with the decoder reading such embeddings (a `Scaffold`, training-only: one
vector per legend entry, page glyph and filler cell) in place of the vision tower's output,
while the vision tower is distilled to produce them. Once the lookup has formed (`Handover`),
the decoder's input moves linearly from the scaffold to the vision tower, and the rest of
training is the plain model, end to end. The scaffold is discarded: the shipped model is an
ordinary Qwen2-VL that reads pixels.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from kamera_agent.backends import TransformersBackend
from kamera_agent.demo.model import DEMO_MODEL_DIR, demo_config, demo_image_processor, demo_tokenizer
from kamera_agent.demo.sequences import FrameCache, ItemSequence, item_sequence
from kamera_agent.demo.task import BLANK, COLOURS, GLYPHS, DemoItem, QuestionKind, make_item, make_items
from kamera_agent.settings import configure_threads

PAD = 256
MODEL_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw")
WHITE_INK = len(COLOURS)  # the scaffold's ink index for a page's white glyphs (and filler)
BLANK_GLYPH = len(GLYPHS)  # the scaffold's glyph index for a filler cell
INKS = WHITE_INK + 1
SPARSE_SHARE = 0.25
"""Share of training items that are sparse-binding control items."""
COLOUR_SHARE = 0.4
"""Share of training items (sparse controls included) that ask the binding question; the rest ask
the readout."""


class Scaffold(torch.nn.Module):
    """Training-only frame-token embeddings at text-embedding scale: a glyph's vector (or the
    filler's) plus an ink's (a colour, or white), as free as the decoder's own token
    embeddings. Factorised, so a page glyph and its legend entry share the glyph's vector from
    the first step: the decoder only has to learn to match it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.glyphs = torch.nn.Embedding(len(GLYPHS) + 1, hidden)
        self.inks = torch.nn.Embedding(INKS, hidden)
        for table in (self.glyphs, self.inks):
            torch.nn.init.normal_(table.weight, std=0.02)

    def forward(self, glyphs: torch.Tensor, inks: torch.Tensor) -> torch.Tensor:
        return self.glyphs(glyphs) + self.inks(inks)  # type: ignore[no-any-return]


class ScaffoldedVision:
    """Replaces the model's image features by ``share * scaffold + (1 - share) * vision`` and
    keeps both, for the distillation loss. ``share`` 0 is the plain model."""

    def __init__(self, model: Any, scaffold: Scaffold) -> None:
        self.model, self.scaffold, self.share = model, scaffold, 0.0
        self.frame_ids: tuple[torch.Tensor, torch.Tensor] | None = None
        self.vision: torch.Tensor | None = None
        self.target: torch.Tensor | None = None
        self._features = model.model.get_image_features
        model.model.get_image_features = self._mixed

    def _mixed(self, pixel_values: torch.Tensor, image_grid_thw: Any = None, **kwargs: Any) -> Any:
        out = self._features(pixel_values, image_grid_thw, **kwargs)
        sizes = [part.shape[0] for part in out.pooler_output]
        self.vision = torch.cat(out.pooler_output)
        if self.frame_ids is None:
            return out
        self.target = self.scaffold(*self.frame_ids)
        mixed = self.share * self.target + (1.0 - self.share) * self.vision if self.share else self.vision
        out.pooler_output = torch.split(mixed, sizes)
        return out

    def detach(self) -> None:
        """Give the model back its own image features (before saving)."""
        self.model.model.get_image_features = self._features


LOOKUP_LAYER = 2
"""The decoder layer whose attention `seed_lookup` starts as the lookup: the pages bind where it
is seeded, so this sets where the reuse deficit lives. In layer 2 of six the deficit grows with
depth, as the paper measures in real models (seeded in layer 0, the previous model's deficit was
nearly as large in the shallow half as in the deep one); in layer 3 the binding learned more
slowly (the model card has both runs)."""


def seed_lookup(
    model: Any,
    lookup_layer: int = LOOKUP_LAYER,
    query_key: float = 1.0,
    output: float = 0.02,
    copy: float = 0.3,
    quiet: float = 0.1,
) -> None:
    """Training-only initialisation that makes the lookup and the query's readout first-order.

    From random weights each is a second-order problem: an attention must find the right tokens
    and its values must carry what those tokens hold, each useless without the other. On 96-token
    pages with 16 meanings the pages' lookup sat at chance for 500 steps (three runs). So:

    - ``lookup_layer``'s attention starts as an identity path (queries and keys the normalised
      inputs, values passed through, written back at embedding scale): a page token attends to
      tokens like it (the same glyph) and carries what it found (the lookup then formed in ~100
      steps). The layers below start ``quiet`` (their attention and MLP outputs scaled down), so
      what the lookup first compares is still the frame tokens' own embeddings;
    - the second-to-last layer's values and outputs start as an identity (``copy``): what a
      query token attends to (the pages' meanings) is copied into its residual from the start.

    Every weight then trains freely.
    """
    layers = model.model.language_model.layers
    if not 0 <= lookup_layer < len(layers) - 2:
        raise ValueError(f"the lookup goes below the readout layer {len(layers) - 2}, not in {lookup_layer}")
    with torch.no_grad():
        for below in layers[:lookup_layer]:
            below.self_attn.o_proj.weight.mul_(quiet)
            below.mlp.down_proj.weight.mul_(quiet)
        lookup, late = layers[lookup_layer].self_attn, layers[len(layers) - 2].self_attn
        eye = torch.eye(lookup.q_proj.weight.shape[1])
        for projection in (lookup.q_proj, lookup.k_proj):
            projection.weight.copy_(query_key * eye[: projection.weight.shape[0]])
        for attention, scale in ((lookup, output), (late, copy)):
            attention.v_proj.weight.copy_(eye[: attention.v_proj.weight.shape[0]])
            attention.o_proj.weight.copy_(scale * eye[:, : attention.o_proj.weight.shape[1]])


def build(seed: int, lookup_layer: int = LOOKUP_LAYER) -> tuple[Any, TransformersBackend]:
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    config = demo_config()
    config._attn_implementation = "eager"
    model = Qwen2VLForConditionalGeneration(config)
    seed_lookup(model, lookup_layer)
    tokenizer = demo_tokenizer()
    model.generation_config.eos_token_id = [258, 256]
    model.generation_config.pad_token_id = PAD
    backend = TransformersBackend(model, tokenizer=tokenizer, image_processor=demo_image_processor())
    return model, backend


def collate(backend: TransformersBackend, batch: list[ItemSequence]) -> dict[str, torch.Tensor]:
    """Right-padded model inputs; answer, page-binding and legend-colour targets (-100 where
    nothing is asked); every frame token's glyph and ink (for the scaffold), in the order the
    model consumes them."""
    anchor = backend.anchor
    rows, answers, aux, own, names, types, pixels, grids = [], [], [], [], [], [], [], []
    glyphs: list[int] = []
    inks: list[int] = []
    for seq in batch:
        ids = [anchor.input_ids, *(c.input_ids for c in seq.chunks), seq.query_ids, seq.answer_ids]
        mm = [anchor.mm_token_type_ids, *(c.mm_token_type_ids for c in seq.chunks)]
        mm += [torch.zeros_like(seq.query_ids), torch.zeros_like(seq.answer_ids)]
        row = torch.cat(ids)
        answer = torch.full_like(row, -100)
        start = row.numel() - seq.answer_ids.numel()
        answer[start - 1 : row.numel() - 1] = seq.answer_ids  # logits at i predict token i + 1
        target, colour, name = (torch.full_like(row, -100) for _ in range(3))
        offset = anchor.num_tokens
        legend_frames = len(seq.item.legend)
        for index, chunk in enumerate(seq.chunks):
            image = (chunk.mm_token_type_ids == 1).nonzero().flatten() + offset  # raster order
            if index < legend_frames:
                entries = seq.item.legend[index]
                glyphs += [GLYPHS[g] for g, _ in entries]
                inks += [list(COLOURS).index(c) for _, c in entries]
                colour[image] = torch.tensor([_first_token(backend, c) for _, c in entries])
                name[image] = torch.tensor([_first_token(backend, g) for g, _ in entries])
            else:
                page = seq.item.pages[index - legend_frames]
                meaning = seq.item.meaning
                target[image] = torch.tensor(
                    [-100 if g == BLANK else _first_token(backend, meaning[g]) for g in page]
                )
                name[image] = torch.tensor([-100 if g == BLANK else _first_token(backend, g) for g in page])
                glyphs += [BLANK_GLYPH if g == BLANK else GLYPHS[g] for g in page]
                inks += [WHITE_INK] * len(page)
            offset += chunk.num_tokens
        rows.append(row), answers.append(answer), aux.append(target), own.append(colour), names.append(name)
        types.append(torch.cat(mm))
        pixels += [c.pixel_values for c in seq.chunks]
        grids += [c.image_grid_thw for c in seq.chunks]
    width = max(r.numel() for r in rows)

    def pad(tensors: list[torch.Tensor], value: int) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(t, (0, width - t.numel()), value=value) for t in tensors])

    return {
        "input_ids": pad(rows, PAD),
        "attention_mask": pad([torch.ones_like(r) for r in rows], 0),
        "mm_token_type_ids": pad(types, 0),
        "pixel_values": torch.cat(pixels),  # type: ignore[arg-type]
        "image_grid_thw": torch.cat(grids),  # type: ignore[arg-type]
        "answer_targets": pad(answers, -100),
        "binding_targets": pad(aux, -100),
        "legend_targets": pad(own, -100),
        "glyph_targets": pad(names, -100),
        "frame_glyphs": torch.tensor(glyphs),
        "frame_inks": torch.tensor(inks),
    }


def _first_token(backend: TransformersBackend, text: str) -> int:
    return int(backend.encoder.tokens(text)[0])


def losses(
    model: Any,
    batch: dict[str, torch.Tensor],
    aux_weight: float,
    vision: ScaffoldedVision,
    glyph_names: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss, and the batch's answer accuracy (first token), binding accuracy (page
    tokens predicting what their glyph means) and distillation error (vision vs scaffold)."""
    vision.frame_ids = (batch["frame_glyphs"], batch["frame_inks"])
    logits = model(**{k: batch[k] for k in MODEL_INPUTS}).logits  # [B, L, V]
    flat = logits.reshape(-1, logits.shape[-1])
    answer = torch.nn.functional.cross_entropy(flat, batch["answer_targets"].reshape(-1), ignore_index=-100)
    binding = batch["binding_targets"]
    aux = torch.nn.functional.cross_entropy(flat, binding.reshape(-1), ignore_index=-100)
    legend = batch["legend_targets"].reshape(-1)
    aux = aux + torch.nn.functional.cross_entropy(flat, legend, ignore_index=-100)
    if glyph_names:
        names = batch["glyph_targets"].reshape(-1)
        aux = aux + torch.nn.functional.cross_entropy(flat, names, ignore_index=-100)
    assert vision.vision is not None and vision.target is not None
    target = vision.target.detach()
    distill = (vision.vision - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-12)
    first = (batch["answer_targets"] != -100).int().argmax(-1)  # where the first answer token is predicted
    rows = torch.arange(logits.shape[0])
    accuracy = (logits[rows, first].argmax(-1) == batch["answer_targets"][rows, first]).float().mean()
    asked = binding != -100
    bound = (logits[asked].argmax(-1) == binding[asked]).float().mean()
    metrics = {"accuracy": accuracy.item(), "binding": bound.item(), "distill": distill.item()}
    return answer + aux_weight * aux + distill, metrics


def held_out_accuracy(
    model: Any,
    backend: TransformersBackend,
    cache: FrameCache,
    vision: ScaffoldedVision,
    count: int,
    seed: int,
    kind: QuestionKind = "colour",
) -> float:
    """Re-prefill accuracy (first answer token) of the plain model (no scaffold) on held-out items."""
    items = [item_sequence(cache, item) for item in make_items(count, seed, kind=kind)]
    correct, share = 0, vision.share
    vision.share = 0.0
    with torch.no_grad():
        for start in range(0, count, 50):
            batch = collate(backend, items[start : start + 50])
            _, metrics = losses(model, batch, 0.0, vision)
            correct += round(metrics["accuracy"] * len(items[start : start + 50]))
    vision.share = share
    return correct / count


def training_items(
    rng: random.Random, count: int, warming: bool = False, colour_share: float = COLOUR_SHARE
) -> list[DemoItem]:
    """A batch of fresh items, ``colour_share`` of them binding questions and `SPARSE_SHARE`
    sparse-binding control items; while the lookup forms (``warming``), pages of
    `WARMING_GLYPHS` glyphs instead."""

    def kind() -> QuestionKind:
        return "colour" if rng.random() < colour_share else "glyph"

    if warming:
        return [make_item(rng, kind(), glyphs_shown=rng.choice(WARMING_GLYPHS)) for _ in range(count)]
    return [make_item(rng, kind(), sparse=rng.random() < SPARSE_SHARE) for _ in range(count)]


WARMING_GLYPHS = (15, 30, 60, 128)
"""Glyphs over the pages before the hand-over: on dense pages a glyph's legend entry competes
with eight white copies of the same glyph for its attention; sparser pages let the lookup form
first, on entries it can tell apart."""


def anneal(step: int, steps: int, start: float, end: float) -> float:
    """The auxiliary loss's weight factor: 1 until ``start·steps``, linearly to 0 at ``end·steps``."""
    at = step / max(1, steps)
    if at <= start:
        return 1.0
    return max(0.0, 1.0 - (at - start) / max(1e-9, end - start))


class Handover:
    """The scaffold's share of the decoder's input: 1 until the lookup has formed (the pages'
    binding accuracy over the last 50 steps reaches ``ready``, or ``patience`` steps pass), then
    linearly down to 0 over ``steps``: the rest of training is the plain model."""

    def __init__(self, steps: int, ready: float = 0.9, patience: int = 2000) -> None:
        self.steps, self.ready, self.patience = steps, ready, patience
        self.began: int | None = None

    def share(self, step: int, log: list[dict[str, float]]) -> float:
        if self.began is None:
            recent = [r["binding"] for r in log[-50:]]
            formed = len(recent) == 50 and sum(recent) / 50 >= self.ready
            if formed or step >= self.patience:
                self.began = step
            else:
                return 1.0
        return max(0.0, 1.0 - (step - self.began) / max(1, self.steps))


def save_plain(model: Any, backend: TransformersBackend, vision: ScaffoldedVision, out: Path) -> None:
    """Save the model as an ordinary Qwen2-VL folder: its own image features, no scaffold."""
    vision.detach()
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    backend.tokenizer.save_pretrained(out)
    backend.encoder.image_processor.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2200)
    parser.add_argument(
        "--until", type=int, default=None, help="stop after this step (checkpointed; --resume continues)"
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--aux-weight", type=float, default=2.0)
    parser.add_argument("--anneal-from", type=float, default=0.6, help="share of steps: aux starts fading")
    parser.add_argument("--anneal-to", type=float, default=0.85, help="share of steps: aux is zero from here")
    parser.add_argument("--handover-steps", type=int, default=400)
    parser.add_argument(
        "--handover-after", type=int, default=900, help="start the hand-over by this step even if unbound"
    )
    parser.add_argument("--colour-share", type=float, default=COLOUR_SHARE, help="share of binding questions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-glyph-names", action="store_true", help="drop the aux loss on frame tokens' glyph names"
    )
    parser.add_argument(
        "--lookup-layer", type=int, default=LOOKUP_LAYER, help="the layer seed_lookup starts as the lookup"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--checkpoint", type=Path, default=Path("training/checkpoint.pt"))
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--export",
        action="store_true",
        help="write the checkpoint's plain model to --out and stop (to measure a run mid-way)",
    )
    parser.add_argument("--eval-every", type=int, default=100)
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    model, backend = build(args.seed, args.lookup_layer)
    scaffold = Scaffold(model.config.text_config.hidden_size)
    vision = ScaffoldedVision(model, scaffold)
    cache = FrameCache(backend.encoder)
    parameters = [*model.parameters(), *scaffold.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    step, rng_state, log, spent = 0, None, [], 0.0
    handover = Handover(args.handover_steps, patience=args.handover_after)
    if args.export and not args.checkpoint.is_file():
        raise SystemExit(f"--export: no checkpoint at {args.checkpoint}")
    if (args.resume or args.export) and args.checkpoint.is_file():
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        scaffold.load_state_dict(saved["scaffold"])
        optimizer.load_state_dict(saved["optimizer"])
        step, rng_state, log = saved["step"], saved["rng"], saved["log"]
        spent = saved.get("seconds", 0.0)
        handover.began = saved.get("handover_began")
    if args.export:
        save_plain(model, backend, vision, args.out)
        print(f"wrote the plain model of step {step} to {args.out}")
        return
    rng = random.Random(args.seed)
    if rng_state is not None:
        rng.setstate(rng_state)

    def lr_at(i: int) -> float:
        warm = min(1.0, (i + 1) / 100)
        return args.lr * warm * 0.5 * (1 + math.cos(math.pi * min(1.0, i / args.steps)))

    began = time.time()
    model.train()
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    with Progress(*columns, TextColumn("{task.fields[status]}")) as progress:
        task = progress.add_task("training kamera-tiny-vl", total=args.steps, completed=step, status="")
        while step < min(args.steps, args.until or args.steps):
            items = training_items(rng, args.batch, handover.began is None, args.colour_share)
            batch = collate(backend, [item_sequence(cache, item) for item in items])
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            vision.share = handover.share(step, log)
            aux = args.aux_weight * anneal(step, args.steps, args.anneal_from, args.anneal_to)
            loss, metrics = losses(model, batch, aux, vision, not args.no_glyph_names)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            step += 1
            log.append(
                {"step": step, "loss": float(loss.detach()), "scaffold": vision.share, "aux": aux, **metrics}
            )
            status = (
                f"loss {log[-1]['loss']:.3f} acc {metrics['accuracy']:.2f} binding {metrics['binding']:.2f} "
                f"scaffold {vision.share:.2f} aux {aux:.2f}"
            )
            progress.update(task, advance=1, status=status)
            if step % args.eval_every == 0 or step in (args.steps, args.until):
                model.eval()
                held = held_out_accuracy(model, backend, cache, vision, 100, seed=10_000)
                readout = held_out_accuracy(model, backend, cache, vision, 100, seed=10_000, kind="glyph")
                model.train()
                log[-1]["held_out_accuracy"], log[-1]["held_out_readout"] = held, readout
                recent = log[-args.eval_every :]
                mean = {
                    k: sum(r[k] for r in recent) / len(recent) for k in ("accuracy", "binding", "distill")
                }
                progress.console.print(
                    f"step {step}: scaffold {vision.share:.2f}, train accuracy {mean['accuracy']:.3f}, "
                    f"binding {mean['binding']:.3f}, distill {mean['distill']:.3f}, "
                    f"held-out accuracy (plain model) {held:.3f}, readout {readout:.3f}",
                    highlight=False,
                )
                args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
                torch.save(
                    {
                        "model": model.state_dict(),
                        "scaffold": scaffold.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "step": step,
                        "rng": rng.getstate(),
                        "log": log,
                        "seconds": spent + time.time() - began,
                        "handover_began": handover.began,
                    },
                    args.checkpoint,
                )
    if step < args.steps:
        print(f"stopped at step {step} of {args.steps}; --resume continues")
        return
    save_plain(model, backend, vision, args.out)
    summary = {
        "steps": step,
        "seconds": spent + time.time() - began,
        "threads": args.threads,
        "batch": args.batch,
        "lr": args.lr,
        "handover_began": handover.began,
        "handover_steps": args.handover_steps,
        "aux_weight": args.aux_weight,
        "anneal": [args.anneal_from, args.anneal_to],
        "sparse_share": SPARSE_SHARE,
        "colour_share": args.colour_share,
        "final": log[-1],
        "seed": args.seed,
        "lookup_layer": args.lookup_layer,
        "glyph_names": not args.no_glyph_names,
    }
    evals = [r for r in log if "held_out_accuracy" in r]
    (args.out / "training_log.json").write_text(json.dumps({"summary": summary, "evals": evals}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
