"""Web agent: a planner and a grounder browsing over a three-screenshot window, going back by recall.

The "web" is a handful of small pages the example ships and draws with Pillow (a title bar,
a few lines of text, buttons); nothing is fetched. Each page change pushes the new screenshot
and the window slides. The planner (which button next?) and the grounder (where is that
button?) are two branches of one window (`fork`) sharing its store: the planner's push encodes
a screenshot once, the grounder's push of the same screenshot is a store hit with zero
forwards (same pixels, same pages before it: its KV in that context is stored). "Go back" to a
page that has slid out recalls it in both windows with no vision encode; the planner re-forms it
over its new left context (a prefix cache prefills it too), the grounder then finds that in the
store. The table shows every op's cost beside what a prefix cache (one radix cache serving both
branches) and a full re-prefill would prefill.

    python examples/web_agent.py                  # the shipped demo model
    python examples/web_agent.py --model path/to/Qwen2.5-VL-3B-Instruct --size 224
"""

from __future__ import annotations

from dataclasses import dataclass

from _shared import CostLog, example_parser, open_window
from PIL import Image, ImageDraw

from kamera_agent import ChunkRef, WindowConfig

GOAL = "buy a glass kettle with good reviews"


@dataclass(frozen=True)
class Page:
    """A page as the browser would draw it: a title, text lines and buttons."""

    title: str
    lines: tuple[str, ...]
    buttons: tuple[str, ...]


PAGES = {
    "home": Page("shop.local", ("Deals of the day", "Kettles -20%"), ("Search", "Cart")),
    "search": Page("Search", ("query: glass kettle",), ("Go",)),
    "results": Page("Results", ("Steel kettle $25", "Glass kettle $31"), ("Open", "Next")),
    "product": Page("Glass kettle", ("1.7 l, 2200 W", "In stock"), ("Specs", "Reviews")),
    "specs": Page("Specs", ("Borosilicate glass", "Auto shut-off"), ("Reviews",)),
    "reviews": Page("Reviews", ("2/5 lid is loose", "1/5 it leaks"), ("Back",)),
}
OPENED = ("home", "search", "results", "product", "specs", "reviews")
TRAJECTORY = (*(("open", name) for name in OPENED), ("back", "results"))  # reviews are bad: back


def screenshot(page: Page, size: int) -> Image.Image:
    """Draw ``page`` at 112 x 112 (title bar, text, buttons), scaled to ``size`` pixels."""
    image = Image.new("RGB", (112, 112), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, 111, 15), fill=(40, 60, 140))
    draw.text((4, 3), page.title, fill="white")
    for row, line in enumerate(page.lines):
        draw.text((4, 22 + 14 * row), line, fill="black")
    for col, label in enumerate(page.buttons):
        box = (4 + 54 * col, 88, 52 + 54 * col, 106)
        draw.rounded_rectangle(box, radius=4, fill=(225, 225, 235), outline=(80, 80, 80))
        draw.text((box[0] + 4, box[1] + 4), label, fill="black")
    return image.resize((size, size))


@dataclass(frozen=True)
class WebRun:
    """Every op's cost (planner and grounder) and each (role, prompt, answer)."""

    log: CostLog
    answers: list[tuple[str, str, str]]


def main(argv: list[str] | None = None) -> WebRun:
    parser = example_parser(__doc__)
    parser.add_argument("--capacity", type=int, default=3, help="screenshots the window keeps (default: 3)")
    parser.add_argument("--size", type=int, default=112, help="screenshot side in pixels (default: 112)")
    args = parser.parse_args(argv)
    config = WindowConfig(capacity_chunks=args.capacity, max_new_tokens=args.max_new_tokens)
    planner = open_window(args, config)
    windows = {"planner": planner, "grounder": planner.fork()}  # branches sharing one store
    seen: dict[tuple[str, str], ChunkRef] = {}
    log, answers = CostLog(), []
    for step, (action, name) in enumerate(TRAJECTORY, start=1):
        page = PAGES[name]
        for role, window in windows.items():
            ref = seen.get((role, name))
            if action == "back" and ref is not None and ref in window.evicted:
                window.recall(ref)
                log.record(step, "recall", f"{role}: {name}", window)
            else:
                seen[role, name] = window.push(screenshot(page, args.size), kind="screenshot", label=name)
                log.record(step, "push", f"{role}: {name}", window)
        prompts = {
            "planner": f"Goal: {GOAL}. Which button next?",
            "grounder": f"Where is the {page.buttons[0]!r} button?",
        }
        for role, prompt in prompts.items():
            window = windows[role]
            answers.append((role, prompt, window.ask(prompt).text))
            log.record(step, "ask", f"{role}: {name}", window, prompt)
    log.print(f"web agent: {args.capacity}-screenshot window, planner and grounder")
    hits = [row.cost for row in log.rows if row.op == "push" and row.what.startswith("grounder")]
    print(
        f"grounder pushes: {len(hits)}, forwards {sum(c.forwards for c in hits)}, vision encodes "
        f"{sum(c.vision_encodes for c in hits)}: the planner's encodes, served from the store"
    )
    for role, prompt, text in answers[-2:]:
        print(f"{role}: {prompt} -> {text!r}")
    return WebRun(log, answers)


if __name__ == "__main__":
    main()
