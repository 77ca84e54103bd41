"""The engines' GPU check (issue 32 item 5): what can be checked on a GPU without vLLM or SGLang.

The lent device has torch and transformers but neither engine (and no network), so this checks
kamera's own side of the engine path on the device, in the dtypes engines run:

1. **vLLM slot I/O.** For every ``KVCacheLayout`` vLLM 0.32 resolves (the per-layer view
   ``[blocks, heads, block_size, C]`` over a buffer in that physical order, built here as
   ``create_kv_cache_views`` builds it) and every backend kamera addresses by indexing
   (FLASH_ATTN / TRITON_ATTN, FLASHINFER, the MLA backends): tokens written by kamera's
   ``write_tokens`` at random slots are read back the way that backend's kernel unpacks the view
   (FlashAttention's ``transpose(1, 2).split``, FlashInfer's physical order split, MLA's
   ``squeeze(1)``) and must be bit-equal; then the time to write and read 8k tokens of a
   7B-class shape (28 layers, 4 KV heads, head 128) on the device.
2. **Relocation** on a real transformers Qwen2 (random, 4 layers): a chunk's KV computed at
   position 0, made position-free and relocated to position p, against the model's own KV of
   the chunk at p (relative error), in fp32 and bf16.
3. **Window exactness** on the shipped demo model (Qwen2-VL class) under
   ``WindowConfig.exact()``: after each op of a short episode (push images and text, reorder,
   evict, recall, slide) the window's first answer logits against the model's own forward over
   the same full sequence (``as_model_inputs``): argmax agreement and KL, in fp32 and bf16.

    python benchmarks/engine_gpu_check.py --json engine_gpu.json   # on the GPU, ~1 min
    python benchmarks/engine_gpu_check.py --device cpu --quick     # the CPU smoke test

On the device, pydantic (which the image lacks) is carried as wheels: ``scripts/device_wheels.sh``
downloads them into ``.device/`` here; docs/vllm.md gives the one ``run`` command.
Exits non-zero if a layout round trip is not bit-equal or a window answer's argmax differs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kamera_agent.engines.vllm.addressing import layer_addressing, read_tokens, write_tokens
from kamera_agent.operator.layout import ChunkKV, KVLayout, relocate, to_position_free
from kamera_agent.operator.rope import RotarySpec

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
"""vLLM 0.32's ``KVCacheLayout`` names: the physical order of layer, block, head, token, content."""
PAGED = ("FLASH_ATTN", "FLASHINFER")
LATENT = ("FLASHMLA", "TRITON_MLA")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="toy sizes (the CPU smoke test)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    report: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    report["layouts"] = _layouts(device)
    report["slot_io"] = _slot_io(device, args.quick)
    report["relocation"] = _relocation(device)
    report["window"] = _window(device, args.quick)
    failed = [r for r in report["layouts"] if not r["equal"]]
    failed += [r for r in report["window"] if not r["argmax_equal"]]
    report["ok"] = not failed
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    if failed:
        raise SystemExit(f"{len(failed)} checks failed: {failed[:3]}")
    return report


# -- 1. vLLM slot I/O ----------------------------------------------------------------------
def layer_views(
    name: str,
    layers: int,
    blocks: int,
    heads: int,
    block: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One ``[blocks, heads, block_size, width]`` view per layer over one buffer whose physical
    order is ``name``'s (L layer, B block, H head, N token, C content), as vLLM builds them."""
    sizes = {"L": layers, "B": blocks, "H": heads, "N": block, "C": width}
    buffer = torch.zeros([sizes[c] for c in name], dtype=dtype, device=device)
    order = [c for c in name if c != "L"]
    views = []
    for layer in range(layers):
        view = buffer.select(name.index("L"), layer)
        views.append(view.permute(*(order.index(c) for c in "BHNC")))
    return views


def _kernel_read(
    backend: str, name: str, view: torch.Tensor, split: int, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens at ``slots`` as ``backend``'s kernel unpacks the view: ``[tokens, heads, dim]``."""
    n = view.shape[2]
    blocks, offsets = slots // n, slots % n
    if backend in LATENT:  # MLAAttention: kv.squeeze(1) -> [blocks, block_size, latent | k_pe]
        rows = view.squeeze(1)[blocks, offsets]
        return rows[:, None, :split], rows[:, None, split:]
    if backend == "FLASHINFER":  # the view permuted to its physical order, told NHD or HND
        order = [c for c in name if c != "L"]
        physical = view.permute(*("BHNC".index(c) for c in order))
        k, v = physical.split(split, dim=-1)
        if order.index("N") < order.index("H"):  # NHD: [B, N, H, D]
            return k[blocks, offsets], v[blocks, offsets]
        return k[blocks, :, offsets], v[blocks, :, offsets]
    k, v = view.transpose(1, 2).split(split, dim=-1)  # FlashAttention / Triton: [B, N, H, D]
    return k[blocks, offsets], v[blocks, offsets]


def _layouts(device: torch.device) -> list[dict[str, Any]]:
    blocks, block, heads, head, lora, rope = 12, 16, 2, 32, 64, 16
    rows = []
    for name, dtype, backend in itertools.product(
        LAYOUTS, (torch.float32, torch.float16, torch.bfloat16), PAGED + LATENT
    ):
        if backend == "FLASHINFER" and name == "LHBNC":
            continue  # FlashInfer has no name for a head-outer layout: vLLM never resolves it
        latent = backend in LATENT
        h, dk, dv = (1, lora, rope) if latent else (heads, head, head)
        model = KVLayout(
            "mla" if latent else "gqa", 2, (h, dk), (h, dv), "values" if latent else "keys", _spec(dv)
        )
        views = layer_views(name, 2, blocks, h, block, dk + dv, dtype, device)
        where = layer_addressing(backend, views[1], model, h)
        slots = torch.randperm(blocks * block, device=device)[:40]
        keys = torch.randn(40, h, dk, device=device).to(dtype)
        values = torch.randn(40, h, dv, device=device).to(dtype)
        write_tokens(views[1], where, keys, values, slots)
        k, v = _kernel_read(backend, name, views[1], dk, slots)
        back_k, back_v = read_tokens(views[1], where, slots)
        untouched = not views[0].any()  # the other layer of the same buffer stays zero
        equal = all(torch.equal(a, b) for a, b in ((k, keys), (v, values), (back_k, keys), (back_v, values)))
        rows.append(
            {"layout": name, "dtype": str(dtype)[6:], "backend": backend, "equal": equal and untouched}
        )
    return rows


def _slot_io(device: torch.device, quick: bool) -> dict[str, Any]:
    """Write then read ``tokens`` tokens into every layer of a 7B-class cache (bf16, NHD)."""
    layers, heads, head, tokens = (4, 2, 32, 256) if quick else (28, 4, 128, 8192)
    block, blocks = 16, tokens // 16 + 8
    model = KVLayout("gqa", layers, (heads, head), (heads, head), "keys", _spec(head))
    views = layer_views("LBNHC", layers, blocks, heads, block, 2 * head, torch.bfloat16, device)
    where = [layer_addressing("FLASH_ATTN", v, model, heads) for v in views]
    slots = torch.randperm(blocks * block, device=device)[:tokens]
    keys = torch.randn(tokens, heads, head, device=device, dtype=torch.bfloat16)

    def timed(run: Any) -> float:
        run()  # warm
        _sync(device)
        began = time.perf_counter()
        for _ in range(5):
            run()
        _sync(device)
        return (time.perf_counter() - began) / 5 * 1e3

    write_ms = timed(
        lambda: [write_tokens(c, w, keys, keys, slots) for c, w in zip(views, where, strict=True)]
    )
    read_ms = timed(lambda: [read_tokens(c, w, slots) for c, w in zip(views, where, strict=True)])
    return {"layers": layers, "tokens": tokens, "write_ms": round(write_ms, 3), "read_ms": round(read_ms, 3)}


# -- 2. relocation ---------------------------------------------------------------------------
def _relocation(device: torch.device) -> list[dict[str, Any]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kamera_agent.backends.transformers.reading import kv_layout_of_config

    config = Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=8192,
    )
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(1)
        model = cast(Qwen2ForCausalLM(config), device, dtype)
        layout = kv_layout_of_config(config)
        ids = torch.randint(0, 512, (1, 48), device=device)
        for shift in (1, 977, 6000):
            at_zero = _kv(model, ids, 0)
            at_shift = _kv(model, ids, shift)
            free = to_position_free(
                ChunkKV(at_zero.keys.float(), at_zero.values.float(), torch.arange(48)), layout
            )
            moved = relocate(free, layout, torch.arange(shift, shift + 48))
            error = (moved.keys - at_shift.keys.float()).norm() / at_shift.keys.float().norm()
            rows.append({"dtype": str(dtype)[6:], "shift": shift, "keys_relative_error": float(error)})
    return rows


def _kv(model: Any, ids: torch.Tensor, start: int) -> ChunkKV:
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    with torch.no_grad():
        cache = model(input_ids=ids, position_ids=positions, use_cache=True).past_key_values
    keys = torch.stack([cache.layers[i].keys[0] for i in range(len(cache.layers))]).cpu()
    values = torch.stack([cache.layers[i].values[0] for i in range(len(cache.layers))]).cpu()
    return ChunkKV(keys, values, positions[0].cpu())


# -- 3. window exactness -------------------------------------------------------------------
def _window(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    import random

    from kamera_agent.backends.base import DecodeConfig
    from kamera_agent.config import WindowConfig
    from kamera_agent.demo.model import load_demo_model
    from kamera_agent.demo.task import make_item, render_legend, render_page
    from kamera_agent.divergence import next_token_kl
    from kamera_agent.window import KameraWindow

    rows = []
    for dtype in (torch.float32,) if quick else (torch.float32, torch.bfloat16):
        model, tokenizer, processor = load_demo_model()
        model = cast(model, device, dtype)
        config = WindowConfig.exact().model_copy(
            update={"evicted_pixels": "retain"}
        )  # the reference needs them
        window = KameraWindow(model, tokenizer=tokenizer, image_processor=processor, config=config)
        item = make_item(random.Random(3), "colour")
        legend = [
            window.push(render_legend(entries), label=f"legend {i}") for i, entries in enumerate(item.legend)
        ]
        pages = [
            window.push(render_page(cells), kind="frame", label=f"page {k}")
            for k, cells in enumerate(item.pages)
        ]
        note = window.push("an earlier note about the pages", label="note")
        ops: list[tuple[str, Callable[[], object]]] = [
            ("push", lambda: None),
            ("reorder", partial(window.reorder, [*reversed(legend), note, *pages])),
            ("evict", partial(window.evict, pages[0])),
            ("recall", partial(window.recall, pages[0], at=1)),
            ("slide", partial(window.slide, 1)),
        ]
        for op, run in ops:
            run()
            answer = window.ask(item.question, decode=DecodeConfig(max_new_tokens=1))
            inputs = window.as_model_inputs(item.question)
            with torch.no_grad():
                moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
                logits = model(**moved).logits[0, -1].float().cpu()
            mine = answer.first_logits.float().cpu()
            rows.append(
                {
                    "dtype": str(dtype)[6:],
                    "op": op,
                    "argmax_equal": int(mine.argmax()) == int(logits.argmax()),
                    "kl": next_token_kl(logits, mine),
                }
            )
        window.close()
    return rows


def cast(model: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """``model`` on ``device`` in ``dtype`` as a bf16 checkpoint loads (``from_pretrained(dtype=)``):
    its rotary ``inv_freq`` stays fp32. A plain ``.to(bfloat16)`` rounds it too, and then the
    model's own rotation drifts with the position (keys 58 % off at position 6,000 on this
    shape) while an engine's fp32 cos/sin tables do not."""
    frequencies = {name: b.clone() for name, b in model.named_buffers() if name.endswith("inv_freq")}
    model = model.to(device=device, dtype=dtype).eval()
    for name, kept in frequencies.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, kept.to(device))
    return model


def _spec(dim: int) -> RotarySpec:
    return RotarySpec(inv_freq=1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), pairing="half")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
