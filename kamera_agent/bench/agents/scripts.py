"""The four agents of ``kamera bench --suite agents``, each a deterministic script of window ops.

- **stream** (push-only): new chunks into an unbounded window, a question every few pushes;
  nothing moves, so kamera should prefill what a prefix cache does (the ≤ 1.05× claim).
- **video**: a sliding window of frames over a longer clip (FIFO eviction at capacity), a
  question every few frames; a prefix cache re-prefills every frame after each slide.
- **web**: a browsing agent over a growing transcript: each step appends an action/observation
  line and a new screenshot; only the newest screenshots stay, the oldest is replaced in its
  slot by its caption. A step is one op, as an agent sends one request per step: `replace`
  with the line and screenshot appended (`extend` while no screenshot is due to go).
- **document**: a coarse-to-fine reader: low-detail views of every page first, then detailed
  pages in a working set (the oldest detailed page evicted as each new one comes), going back
  to an earlier page now and then (recalled in reading order, right after the overviews).

Sizes (steps, capacities) are `AgentCounts`; tokens per chunk come from the contents.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kamera_agent.bench.agents.contents import Contents
from kamera_agent.bench.agents.script import Question, Script, ScriptBuilder

__all__ = ["AGENTS", "QUICK_TOKENS", "REALISTIC_TOKENS", "AgentCounts"]

REALISTIC_TOKENS: Mapping[str, int] = MappingProxyType(
    {"item": 48, "frame": 40, "line": 16, "screenshot": 64, "caption": 8, "overview": 16, "page": 64}
)
"""Tokens per chunk on the realistic shape: real frames and screenshots are longer, but the
whole suite must fit ~20 minutes on 2 CPU cores; every size but captions, lines and overviews
is above the default patch rank (32), so default patches are truncated, not lossless."""
QUICK_TOKENS: Mapping[str, int] = MappingProxyType(
    {"item": 12, "frame": 10, "line": 4, "screenshot": 16, "caption": 3, "overview": 4, "page": 16}
)


@dataclass(frozen=True)
class AgentCounts:
    """How long each agent runs and how much its window holds (the same on every model)."""

    stream_chunks: int = 32
    video_frames: int = 64
    video_capacity: int = 16
    web_steps: int = 40
    web_screenshots: int = 3
    document_pages: int = 12
    document_working: int = 4
    ask_every: int = 4
    """Stream and video: a question after every this many pushes."""
    web_ask_every: int = 2
    document_back_every: int = 3
    """Document: the reader goes back after every this many detailed pages."""

    @classmethod
    def quick(cls) -> AgentCounts:
        """Smoke sizes: every op kind still happens (slides, replacements, recalls)."""
        return cls(
            stream_chunks=8,
            video_frames=10,
            video_capacity=4,
            web_steps=6,
            web_screenshots=2,
            document_pages=6,
            document_working=2,
        )

    @classmethod
    def text(cls) -> AgentCounts:
        """A real text model's sizes at agents' lengths (`TEXT_LENGTHS`): every window stays
        within an 8k-token context (four tool outputs of up to 2,000 tokens each), every op kind
        happens, and the four agents with a re-prefill after every step fit ~25 minutes of a
        135M-parameter model on 2 CPU cores."""
        return cls(
            stream_chunks=4,
            video_frames=8,
            video_capacity=3,
            web_steps=8,
            web_screenshots=2,
            document_pages=4,
            document_working=2,
            ask_every=2,
        )


def _push(builder: ScriptBuilder, contents: Contents, kind: str, index: int) -> str:
    chunk = contents.make(kind, index)
    assert chunk.label is not None
    builder.push(chunk.label, chunk, kind)
    return chunk.label


def _questions(contents: Contents) -> Iterator[Question]:
    return (contents.question(i) for i in itertools.count())


def stream(contents: Contents, counts: AgentCounts) -> Script:
    n, every = counts.stream_chunks, counts.ask_every
    builder = ScriptBuilder(
        "stream", f"{n} new chunks pushed into an unbounded window, a question every {every}"
    )
    questions = _questions(contents)
    for i in range(n):
        label = _push(builder, contents, "item", i)
        builder.step("push", label, next(questions) if (i + 1) % every == 0 else None)
    return builder.build()


def video(contents: Contents, counts: AgentCounts) -> Script:
    n, cap, every = counts.video_frames, counts.video_capacity, counts.ask_every
    summary = f"a {cap}-frame sliding window (FIFO) over {n} new frames, a question every {every}"
    builder, questions = ScriptBuilder("video", summary, capacity=cap), _questions(contents)
    for i in range(n):
        leaving = builder.lineup[0] if len(builder.lineup) >= cap else None
        label = _push(builder, contents, "frame", i)
        detail = label if leaving is None else f"{label} in, {leaving} out"
        builder.step("frame", detail, next(questions) if (i + 1) % every == 0 else None)
    return builder.build()


def web(contents: Contents, counts: AgentCounts) -> Script:
    steps, shown, every = counts.web_steps, counts.web_screenshots, counts.web_ask_every
    summary = (
        f"{steps} steps: a transcript line and a screenshot each, the {shown} newest screenshots kept, "
        f"the oldest replaced in place by its caption; a question every {every}"
    )
    builder, questions = ScriptBuilder("web", summary), _questions(contents)
    shots: list[str] = []
    for k in range(steps):
        detail = ""
        line, shot = contents.make("line", k), contents.make("screenshot", k)
        assert line.label is not None and shot.label is not None
        new = [(line.label, line, "line"), (shot.label, shot, "screenshot")]
        if len(shots) == shown:
            old = shots.pop(0)
            slot = builder.lineup.index(old)
            caption = contents.make("caption", int(old.rsplit(" ", 1)[1]))
            assert caption.label is not None
            builder.replace(old, caption.label, caption, "caption", append=new)
            detail = f"; {old} -> {caption.label} at slot {slot}"
        else:
            builder.extend(new)
        shots.append(shot.label)
        kind = "replace+append" if detail else "append"
        asked = next(questions) if (k + 1) % every == 0 else None
        builder.step(kind, f"{line.label}, {shot.label}{detail}", asked)
    return builder.build()


def document(contents: Contents, counts: AgentCounts) -> Script:
    pages, working, back = counts.document_pages, counts.document_working, counts.document_back_every
    summary = (
        f"{pages} pages coarse to fine: low-detail views of all, then detailed pages ({working} at a "
        f"time, the oldest evicted), going back to an earlier page every {back} pages"
    )
    builder = ScriptBuilder("document", summary, capacity=pages + working)
    questions = _questions(contents)
    for p in range(pages):
        asked = p in (pages // 2 - 1, pages - 1)
        builder.step("skim", _push(builder, contents, "overview", p), next(questions) if asked else None)
    detailed: list[str] = []  # the detailed pages in the window, left to right
    for p in range(pages):
        leaving = detailed.pop(0) if len(detailed) == working else None
        if leaving is not None:
            builder.evict(leaving)
        detailed.append(_push(builder, contents, "page", p))
        detail = detailed[-1] if leaving is None else f"{detailed[-1]} in, {leaving} out"
        builder.step("read", detail, next(questions) if (p + 1) % 2 == 0 else None)
        target = (p - working) // 2  # an earlier page, evicted by now
        if (p + 1) % back == 0 and target >= 0:
            leaving, label = detailed.pop(0), f"page {target}"
            builder.evict(leaving)
            builder.recall(label, at=pages)  # reading order: before every later detailed page
            detailed.insert(0, label)
            builder.step("go back", f"{label} back at slot {pages}, {leaving} out", next(questions))
    return builder.build()


AGENTS: Mapping[str, Callable[[Contents, AgentCounts], Script]] = MappingProxyType(
    {"stream": stream, "video": video, "web": web, "document": document}
)
"""Every agent of the suite, by name, in the order the suite runs them."""
