"""Train kamera-tiny-vl, the shipped demo model, on the synthetic visual binding task.

    python training/train_demo_model.py                    # 5000 steps: ~25 min on 2 idle cores
    python training/train_demo_model.py --resume           # continue from the last checkpoint

Plain PyTorch on CPU. Each step trains on a batch of items laid out exactly as a KameraWindow
lays them out (anchor, one chunk per frame, the question), with two losses over the full
vocabulary: the answer tokens, and a dense auxiliary loss on the frames' own image tokens
(merged tokens in raster order: top-left, top-right, bottom-left, bottom-right):

- a legend frame's glyph token (top-left) and the swatch token after it (top-right) predict
  the glyph's letter, its two lower swatch tokens its colour: the model learns to read both,
  and the top-right token learns to carry the glyph beside its colour (so a later token can
  find the colour by the glyph);
- every token of a symbol frame (and its vision-end token) predicts the colour its glyph
  *means*: the frame shows the glyph on grey, so the colour must come from the legend frame
  with the same glyph token before it. This is what makes the binding happen on the symbol
  frames' own tokens (cross-chunk conditioning) rather than only on the query side; without it
  a briefly trained tiny model answers from the query alone and blind reuse would not hurt it.
  The model card says so.
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
from kamera_agent.demo.task import make_items
from kamera_agent.settings import configure_threads

PAD = 256


def build(seed: int) -> tuple[Any, TransformersBackend]:
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    config = demo_config()
    config._attn_implementation = "eager"
    model = Qwen2VLForConditionalGeneration(config)
    tokenizer = demo_tokenizer()
    model.generation_config.eos_token_id = [258, 256]
    model.generation_config.pad_token_id = PAD
    backend = TransformersBackend(model, tokenizer=tokenizer, image_processor=demo_image_processor())
    return model, backend


def collate(backend: TransformersBackend, batch: list[ItemSequence]) -> dict[str, torch.Tensor]:
    """Right-padded tensors plus answer and auxiliary targets (-100 where nothing is asked)."""
    anchor = backend.anchor
    rows, answers, aux, pixels, grids, types = [], [], [], [], [], []
    for seq in batch:
        ids = [anchor.input_ids, *(c.input_ids for c in seq.chunks), seq.query_ids, seq.answer_ids]
        mm = [anchor.mm_token_type_ids, *(c.mm_token_type_ids for c in seq.chunks)]
        mm += [torch.zeros_like(seq.query_ids), torch.zeros_like(seq.answer_ids)]
        row = torch.cat(ids)
        answer = torch.full_like(row, -100)
        start = row.numel() - seq.answer_ids.numel()
        answer[start - 1 : row.numel() - 1] = seq.answer_ids  # logits at i predict token i + 1
        target = torch.full_like(row, -100)
        offset = anchor.num_tokens
        for index, chunk in enumerate(seq.chunks):
            image = (chunk.mm_token_type_ids == 1).nonzero().flatten() + offset  # TL, TR, BL, BR
            if index < len(seq.item.legend):
                glyph, colour = seq.item.legend[index]
                target[image[:2]] = _first_token(backend, glyph)
                target[image[2:]] = _first_token(backend, colour)
            else:
                glyph = seq.item.symbols[index - len(seq.item.legend)]
                bound = torch.cat([image, image[-1:] + 1])  # and vision_end
                target[bound] = _first_token(backend, seq.item.meaning[glyph])
            offset += chunk.num_tokens
        rows.append(row), answers.append(answer), aux.append(target), types.append(torch.cat(mm))
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
        "aux_targets": pad(aux, -100),
    }


def _first_token(backend: TransformersBackend, text: str) -> int:
    return int(backend.encoder.tokens(text)[0])


def losses(model: Any, batch: dict[str, torch.Tensor], aux_weight: float) -> tuple[torch.Tensor, float]:
    inputs = {k: v for k, v in batch.items() if not k.endswith("_targets")}
    logits = model(**inputs).logits  # [B, L, V]
    flat = logits.reshape(-1, logits.shape[-1])
    answer = torch.nn.functional.cross_entropy(flat, batch["answer_targets"].reshape(-1), ignore_index=-100)
    aux = torch.nn.functional.cross_entropy(flat, batch["aux_targets"].reshape(-1), ignore_index=-100)
    first = (batch["answer_targets"] != -100).int().argmax(-1)  # where the first answer token is predicted
    rows = torch.arange(logits.shape[0])
    accuracy = (logits[rows, first].argmax(-1) == batch["answer_targets"][rows, first]).float().mean()
    return answer + aux_weight * aux, float(accuracy)


def held_out_accuracy(
    model: Any, backend: TransformersBackend, cache: FrameCache, count: int, seed: int
) -> float:
    """Re-prefill accuracy (first answer token) on held-out items."""
    items = [item_sequence(cache, item) for item in make_items(count, seed)]
    correct = 0
    with torch.no_grad():
        for start in range(0, count, 50):
            batch = collate(backend, items[start : start + 50])
            _, accuracy = losses(model, batch, 0.0)
            correct += round(accuracy * len(items[start : start + 50]))
    return correct / count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--aux-weight", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--checkpoint", type=Path, default=Path("training/checkpoint.pt"))
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--eval-every", type=int, default=250)
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    model, backend = build(args.seed)
    cache = FrameCache(backend.encoder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    step, rng_state, log = 0, None, []
    if args.resume and args.checkpoint.is_file():
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step, rng_state, log = saved["step"], saved["rng"], saved["log"]
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
        while step < args.steps:
            seed = rng.randrange(1 << 30)
            batch = collate(backend, [item_sequence(cache, item) for item in make_items(args.batch, seed)])
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            loss, accuracy = losses(model, batch, args.aux_weight)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            log.append({"step": step, "loss": float(loss.detach()), "train_accuracy": accuracy})
            progress.update(task, advance=1, status=f"loss {float(loss):.3f} acc {accuracy:.2f}")
            if step % args.eval_every == 0 or step == args.steps:
                model.eval()
                held = held_out_accuracy(model, backend, cache, 100, seed=10_000)
                model.train()
                log[-1]["held_out_accuracy"] = held
                recent = log[-args.eval_every :]
                train = sum(r["train_accuracy"] for r in recent) / len(recent)
                progress.console.print(
                    f"step {step}: loss {float(loss):.3f}, train accuracy {train:.3f}, "
                    f"held-out re-prefill accuracy {held:.3f}",
                    highlight=False,
                )
                args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "step": step,
                        "rng": rng.getstate(),
                        "log": log,
                    },
                    args.checkpoint,
                )
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    backend.tokenizer.save_pretrained(args.out)
    backend.encoder.image_processor.save_pretrained(args.out)
    summary = {
        "steps": step,
        "seconds": time.time() - began,
        "threads": args.threads,
        "batch": args.batch,
        "final": log[-1],
        "seed": args.seed,
    }
    (args.out / "training_log.json").write_text(json.dumps({"summary": summary, "log": log[-200:]}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
