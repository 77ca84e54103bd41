"""The GPU checks of issues 12 and 14, as one prepared script for a lent GPU (~10 min on an H200).

1. **Video agent** of ``kamera bench --suite agents`` (a 16-frame sliding window over 64 new
   40-token frames, a question every 4) on a 7B-class random shape in bf16 (28 layers, hidden
   3584, GQA 28/4, MLP 18944): kamera's defaults, its exact settings and the prefix cache (with
   its vision-output cache) side by side: wall time, tokens and forwards.
2. **TTFT after each op against its floor** (the query's own forward over the same assembled
   KV) for a window of 8 × 2048-token pages on that shape.
3. **kamera serve** on a 7B-class random Qwen2-VL (that text shape; the demo model's vision
   tower, tokenizer and processor): one short conversation resending its history with a new
   screenshot each turn, the oldest dropped: time to first token per turn against a cold
   server (a fresh store) given the same messages.

    python benchmarks/gpu_check.py --json gpu.json          # on the GPU machine, bf16
    python benchmarks/gpu_check.py --skip serve --passes 3  # the video agent's steady state too
    python benchmarks/gpu_check.py --quick                   # toy shapes on CPU (the smoke test)

Prints a table per check and writes every figure to ``--json``.
"""

from __future__ import annotations

import argparse
import base64
import io
import time
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.agents.contents import RandomContents
from kamera_agent.bench.agents.records import PREFIX, AgentRun
from kamera_agent.bench.agents.run import run_agent, warm
from kamera_agent.bench.agents.scripts import AGENTS, QUICK_TOKENS, REALISTIC_TOKENS, AgentCounts
from kamera_agent.bench.agents.ttft import TTFTShape, run_ttft
from kamera_agent.bench.common import show_and_save
from kamera_agent.config import WindowConfig
from kamera_agent.models.random_qwen2 import Qwen2Shape, random_qwen2
from kamera_agent.models.tiny_tokenizer import build_byte_tokenizer
from kamera_agent.settings import configure_threads

SEVEN_B = Qwen2Shape(layers=28, hidden=3584, heads=28, kv_heads=4, mlp=18944, vocab=32000)
TOY = Qwen2Shape(layers=2, hidden=64, heads=4, kv_heads=2, mlp=128, vocab=1024)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy shapes on CPU: a smoke run")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--skip", nargs="*", default=[], choices=["video", "ttft", "serve"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="run the video agent this many times on one model: the first pass also grows the "
        "allocator and the store, the later ones are the steady state (each reported)",
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    configure_threads(args.threads or 1)
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    shape = TOY if args.quick else SEVEN_B
    console = Console()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "shape": vars(shape),
    }
    if {"video", "ttft"} - set(args.skip):
        model = random_qwen2(shape, device=device, dtype=dtype, max_positions=32768)
        backend = TransformersBackend(model, tokenizer=build_byte_tokenizer(vocab_size=shape.vocab))
        warm(backend)
        if "video" not in args.skip:
            passes = [_video(backend, shape, args.quick, console) for _ in range(max(1, args.passes))]
            report["video"] = passes[0]
            if len(passes) > 1:
                report["video_passes"] = passes
        if "ttft" not in args.skip:
            report["ttft"] = _ttft(backend, args.quick, console)
        del model, backend
        if device == "cuda":
            torch.cuda.empty_cache()
    if "serve" not in args.skip:
        report["serve"] = _serve(shape, device, dtype, args.quick, console)
    return show_and_save(Table(title="gpu check: done (figures above and in --json)"), report, args.json)


def _video(backend: TransformersBackend, shape: Qwen2Shape, quick: bool, console: Console) -> dict[str, Any]:
    tokens = QUICK_TOKENS if quick else REALISTIC_TOKENS
    contents = RandomContents(backend.encoder, tokens, shape.vocab, seed=0)
    script = AGENTS["video"](contents, AgentCounts.quick() if quick else AgentCounts())
    record = AgentRun.of(script, "gpu")
    with Progress(console=console) as progress:
        run_agent(script, backend, record, progress, reference=PREFIX)
    table = Table(title=f"video agent · {script.summary}")
    for column in ("side", "wall s", "tokens", "forwards", "wall ×", "tokens ×"):
        table.add_column(column, justify="right")
    out: dict[str, Any] = {}
    for side in record.sides:
        figures = {name: record.total(side, name) for name in ("ms", "tokens", "forwards")}
        out[side] = {**figures, "wall_x": record.ratio("ms", side), "tokens_x": record.ratio("tokens", side)}
        table.add_row(
            side,
            f"{figures['ms'] / 1e3:.2f}",
            f"{figures['tokens']:.0f}",
            f"{figures['forwards']:.0f}",
            f"{record.ratio('ms', side):.2f}×",
            f"{record.ratio('tokens', side):.2f}×",
        )
    console.print(table)
    return out


def _ttft(backend: TransformersBackend, quick: bool, console: Console) -> dict[str, Any]:
    shape = TTFTShape.quick() if quick else TTFTShape()
    with Progress(console=console) as progress:
        run = run_ttft(backend, shape, 0, progress)
    table = Table(title=f"time to first token after an op · {shape.chunks} × {shape.tokens} tokens")
    for column in ("op", "placed", "TTFT ms", "floor ms", "TTFT / floor"):
        table.add_column(column, justify="right")
    for row in run.rows:
        table.add_row(
            row.op, str(row.placed), f"{row.ttft_ms:.1f}", f"{row.floor_ms:.1f}", f"{row.ratio:.2f}×"
        )
    console.print(table)
    return run.to_json()


def _serve(
    shape: Qwen2Shape, device: str, dtype: torch.dtype, quick: bool, console: Console
) -> dict[str, Any]:
    """TTFT per turn of a live-like conversation (in process: the server's own request path)."""
    from PIL import Image
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from kamera_agent.demo.model import demo_config, demo_image_processor, demo_tokenizer
    from kamera_agent.serve import KameraServer, ServeSettings
    from kamera_agent.serve.protocol import ChatRequest

    demo = demo_config()
    head_dim = shape.hidden // shape.heads
    half = head_dim // 2
    sections = [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]  # Qwen2-VL's 16/24/24 at 128
    text = {
        **demo.text_config.to_dict(),
        "hidden_size": shape.hidden,
        "intermediate_size": shape.mlp,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections},
        "layer_types": None,
    }
    vision = {**demo.vision_config.to_dict(), "hidden_size": shape.hidden}  # the merger's output width
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=demo.image_token_id,
        video_token_id=demo.video_token_id,
        vision_start_token_id=demo.vision_start_token_id,
        vision_end_token_id=demo.vision_end_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).to(device=device, dtype=dtype).eval()
    backend = TransformersBackend(model, tokenizer=demo_tokenizer(), image_processor=demo_image_processor())

    def screenshot(i: int) -> dict[str, Any]:
        image = Image.new("RGB", (112, 112), (40 * i % 256, 200 - 20 * i % 200, 90))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        return {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}],
        }

    def first_token_ms(server: KameraServer, messages: list[dict[str, Any]]) -> tuple[float, Any]:
        began, first = time.perf_counter(), []

        def seen(piece: str) -> None:
            if not first:
                first.append(time.perf_counter())

        done = server.complete(
            ChatRequest(model="gpu", messages=messages, temperature=0, max_tokens=2), on_text=seen
        )
        return ((first[0] if first else time.perf_counter()) - began) * 1e3, done

    settings = ServeSettings("gpu", WindowConfig(), max_tokens=2)
    live = KameraServer(backend, settings)
    history: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."}]
    rows = []
    table = Table(title="kamera serve · TTFT per turn against a cold server")
    for column in ("turn", "prompt", "cached", "TTFT ms", "cold TTFT ms", "cold / kamera"):
        table.add_column(column, justify="right")
    for turn in range(6):
        messages = [*history, screenshot(turn)]
        ms, done = first_token_ms(live, messages)
        cold_ms, _ = first_token_ms(KameraServer(backend, settings), messages)
        usage = done.usage()
        rows.append({"turn": turn, "ttft_ms": ms, "cold_ttft_ms": cold_ms, **usage})
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        table.add_row(
            str(turn),
            str(usage["prompt_tokens"]),
            str(cached),
            f"{ms:.0f}",
            f"{cold_ms:.0f}",
            f"{cold_ms / ms:.2f}×",
        )
        history += [screenshot(turn), {"role": "assistant", "content": done.answer.text or "."}]
        if len(history) > 5:
            del history[1:3]
    console.print(table)
    return {"turns": rows}


if __name__ == "__main__":
    main()
