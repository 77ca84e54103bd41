"""What a patch should be a difference from: the chunk's canonical, or its first context's KV.

A chunk's first admission now keeps the exact KV its one conditioned forward gives (its KV in
that first context). When the chunk later sits behind other chunks, a rank-m patch can be the
difference from that first-context KV (the *base*: no canonical ever needed) or from the
canonical KV(B|∅) (formed once, when first needed). This measures both, side by side, on the
shipped demo model: a page is first seen behind one item's legend frames, then placed behind
another item's; each rank-m patch's KV is compared with the model's own KV of the page there
(relative error over all layers) and the window's next-token KL to the model's own re-prefill.

    python benchmarks/patch_reference.py            # 100 items, ranks 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from rich.table import Table

from kamera_agent.backends.transformers import TransformersBackend
from kamera_agent.bench.common import show_and_save
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.demo import load_demo_model
from kamera_agent.demo.task import QUESTIONS, make_items, render_legend, render_page
from kamera_agent.divergence import next_token_kl, relative_error
from kamera_agent.operator import ChunkKV, apply_patch, form_patch, to_position_free
from kamera_agent.settings import configure_threads

REFERENCES = ("canonical", "base")


def page_behind(backend: TransformersBackend, legend: list[Chunk], page: Chunk, query: torch.Tensor) -> Any:
    """The model's own forward over ``anchor + legend + page (+ query)``."""
    return backend.reference_prefill([*legend, page], query)


def measure(items: int, ranks: list[int], seed: int) -> dict[str, Any]:
    model, tokenizer, image_processor = load_demo_model()
    backend = TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)
    encoder, layout = backend.encoder, backend.layout
    query = encoder.query_ids(QUESTIONS["colour"])
    pool = make_items(2 * items, seed=seed, kind="colour")
    errors: dict[tuple[str, int], list[float]] = {(ref, r): [] for ref in REFERENCES for r in ranks}
    kls: dict[tuple[str, int], list[float]] = {(ref, r): [] for ref in REFERENCES for r in ranks}
    for first, second in zip(pool[::2], pool[1::2], strict=True):
        page = encoder.image(render_page(first.pages[0]), kind="frame", caption="#1")
        seen = [encoder.image(render_legend(entries)) for entries in first.legend]
        now = [encoder.image(render_legend(entries)) for entries in second.legend]
        canonical = to_position_free(page_behind(backend, [], page, None).kv[1], layout)
        base = to_position_free(page_behind(backend, seen, page, None).kv[-1], layout)
        truth = page_behind(backend, now, page, query)
        target = truth.kv[-1]  # the page's KV behind the new legend, at its positions there
        assert target.positions is not None
        for reference_name, reference in (("canonical", canonical), ("base", base)):
            for rank in ranks:
                patch = form_patch(reference, target, layout, rank)
                kv = apply_patch(reference, patch, layout, target.positions)
                error = max(relative_error(kv.keys, target.keys), relative_error(kv.values, target.values))
                errors[(reference_name, rank)].append(error)
                end = backend.anchor.advance + sum(chunk.advance for chunk in [*now, page])
                logits = _answer(backend, truth.kv[:-1], kv, query, end)
                kls[(reference_name, rank)].append(next_token_kl(truth.logits, logits))
    return {
        "items": items,
        "ranks": ranks,
        "relative_error": {f"{ref}@{r}": statistics.mean(v) for (ref, r), v in errors.items()},
        "kl": {f"{ref}@{r}": statistics.mean(v) for (ref, r), v in kls.items()},
    }


def _answer(
    backend: TransformersBackend, before: Any, page_kv: ChunkKV, query: torch.Tensor, end: int
) -> torch.Tensor:
    """Next-token logits of the query (at position ``end``) over the model's own KV of the anchor
    and legend frames, then ``page_kv``."""
    cache = backend.assemble([*before, page_kv])
    _, logits = backend.forward_tokens(query, backend.positions.text(end, int(query.shape[0])), cache)
    assert logits is not None
    return logits.cpu()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    configure_threads(1)
    report = measure(args.items, args.ranks, args.seed)
    table = Table(
        title=f"A page placed behind another legend ({args.items} items, demo model): patch against …"
    )
    table.add_column("rank", justify="right")
    for ref in REFERENCES:
        table.add_column(f"{ref}: KV rel. error", justify="right")
        table.add_column(f"{ref}: KL", justify="right")
    for rank in args.ranks:
        cells = []
        for ref in REFERENCES:
            cells += [
                f"{report['relative_error'][f'{ref}@{rank}']:.3f}",
                f"{report['kl'][f'{ref}@{rank}']:.2e}",
            ]
        table.add_row(str(rank), *cells)
    return show_and_save(table, report, args.json)


if __name__ == "__main__":
    main()
