"""Document agent: coarse-to-fine reading of a multi-page document, dropping pages only after a probe.

The document is a short manual the example ships, rendered to page images with Pillow. Every
page is pushed and a coarse question is asked over the whole document. A simple reranker
(keyword overlap between the question and each page's text) then reorders the window best
page first: pages relocate, and pages whose earlier pages changed are re-formed where the drift
budget asks (on the demo model, all of them: what a prefix cache prefills too). Before dropping
a page, `probe_without` decodes with and without it; only pages the probe calls disposable are
evicted. The fine question reads what is left. The table shows every op's cost beside what a
prefix cache and a full re-prefill would prefill.

    python examples/document_agent.py                 # the shipped demo model, six pages
    python examples/document_agent.py --model path/to/Qwen2.5-VL-3B-Instruct --size 448
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from _shared import CostLog, example_parser, open_window
from PIL import Image, ImageDraw

from kamera_agent import Probe, WindowConfig

DOCUMENT = (
    ("Kettle manual", "Read all instructions", "before first use.", "Keep the base dry."),
    ("Filling", "Fill between MIN", "and MAX marks.", "Close the lid."),
    ("Boiling", "Press the switch.", "The kettle stops", "by itself."),
    ("Descaling", "Boil water and vinegar,", "leave for an hour,", "rinse the kettle."),
    ("Cleaning", "Wipe the outside", "with a damp cloth."),
    ("Warranty", "Two years from purchase.", "Keep your receipt."),
)
COARSE = "Which page is about descaling?"
FINE = "How do I descale the kettle with vinegar?"
STOP = {"how", "do", "i", "the", "a", "an", "and", "with", "is", "to", "of", "which", "page", "about"}


def render_page(lines: tuple[str, ...], size: int) -> Image.Image:
    """A page image: the first string as its heading, the rest as body lines."""
    page = Image.new("RGB", (112, 112), "white")
    draw = ImageDraw.Draw(page)
    for offset in (0, 1):  # a heading drawn twice, one pixel apart: bold enough
        draw.text((6 + offset, 6), lines[0], fill="black")
    draw.line((6, 20, 106, 20), fill=(120, 120, 120))
    for row, line in enumerate(lines[1:]):
        draw.text((6, 28 + 14 * row), line, fill=(40, 40, 40))
    return page.resize((size, size))


def keywords(text: str) -> set[str]:
    """Lower-case word stems (first five letters), stop words left out: "descaling" ~ "descale"."""
    return {word[:5] for word in re.findall(r"[a-z]+", text.lower()) if word not in STOP}


@dataclass(frozen=True)
class DocumentRun:
    """Each op's cost, the reranker's scores, the order after reorder, the probes and evictions."""

    log: CostLog
    scores: dict[str, int]
    order: list[str]
    probes: dict[str, Probe]
    evicted: list[str]
    answers: dict[str, str]


def main(argv: list[str] | None = None) -> DocumentRun:
    parser = example_parser(__doc__)
    parser.add_argument("--pages", type=int, default=len(DOCUMENT), help="pages to read (default: all 6)")
    parser.add_argument("--size", type=int, default=112, help="page side in pixels (default: 112)")
    parser.add_argument("--threshold", type=float, default=1e-2, help="probe KL below which a page goes")
    args = parser.parse_args(argv)
    config = WindowConfig(probe_threshold=args.threshold, max_new_tokens=args.max_new_tokens)
    window = open_window(args, config)
    log, pages = CostLog(), DOCUMENT[: args.pages]
    refs = []
    for lines in pages:
        refs.append(window.push(render_page(lines, args.size), kind="page", label=lines[0]))
        log.record(1, "push", lines[0], window)
    answers = {COARSE: window.ask(COARSE).text}
    log.record(1, "ask", "coarse", window, COARSE)
    scores = {
        ref.label: len(keywords(FINE) & keywords(" ".join(lines)))
        for ref, lines in zip(refs, pages, strict=True)
    }
    ranked = sorted(refs, key=lambda ref: -scores[ref.label])  # stable: ties keep reading order
    window.reorder(ranked)
    log.record(2, "reorder", f"{ranked[0].label} first", window)
    probes, evicted = {}, []
    for ref in reversed(ranked[1:]):  # the reranker's best page stays; probe the rest, worst first
        probes[ref.label] = probe = window.probe_without(ref, FINE, max_new_tokens=args.max_new_tokens)
        log.record(3, "probe", f"{ref.label} (KL {probe.kl:.0e})", window, FINE, without=ref)
        if probe.disposable:
            window.evict(ref)
            evicted.append(ref.label)
            log.record(3, "evict", ref.label, window)
    answers[FINE] = window.ask(FINE).text
    log.record(4, "ask", "fine", window, FINE)
    log.print(f"document agent: {len(pages)} pages, coarse to fine")
    print("scores:", scores, "| kept:", [ref.label for ref in window.refs], "| evicted:", evicted)
    for question, text in answers.items():
        print(f"{question} -> {text!r}")
    return DocumentRun(log, scores, [ref.label for ref in ranked], probes, evicted, answers)


if __name__ == "__main__":
    main()
