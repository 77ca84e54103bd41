"""The last decode's tokens, still in the retained cache, reused by the chunks that repeat them.

Why: a conversation's next turn sends, right after the messages the window holds, the closing
of the question just answered, the assistant's opening and the answer: the tokens the decode
fed through the model a moment ago, at the same positions, over the same KV. Their cache slots
are the model's own KV of those tokens (a prefix cache, vLLM's or SGLang's, reuses a reply's
blocks the same way), so the formation that admits them reuses as many leading slots as their
ids match and prefills only the rest. An agent's loop otherwise prefills every answer twice.

The plan says so before anything runs (`with_tail`: the first formation's tokens less the
reused ones, ``WindowPlan.tail``); the executor reuses exactly those slots (`rest_after`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from kamera_agent.backends.decoding import decoded_tokens
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.results import Answer
from kamera_agent.window.plan import Step, WindowPlan
from kamera_agent.window.state import WindowRecord

__all__ = ["fed_ids", "rest_after", "with_tail"]


def fed_ids(query_ids: torch.Tensor, answer: Answer) -> torch.Tensor:
    """What a decode appended to the cache: the query's ids, then the answer tokens it fed back
    (all but the last one, unless an end-of-sequence or a cancellation ended the answer)."""
    fed = torch.tensor(answer.tokens[: decoded_tokens(answer)], dtype=torch.long)
    return torch.cat([query_ids.to("cpu", torch.long).flatten(), fed])


def with_tail(state: WindowRecord, plan: WindowPlan, gaps: bool) -> WindowPlan:
    """``plan`` reusing the retained cache's tail where its first in-window formation starts
    right after every chunk the cache holds, each unchanged, and its text chunks' ids begin
    with the tail's: the matched tokens are reused, not prefilled (``plan.tail``)."""
    memo = state.assembled
    if memo is None or memo.tail is None or not memo.tail.numel():
        return plan
    held = len(memo.stretches) - 1  # the chunks the cache holds, the anchor first
    if held < 1 or len(plan.order) <= held:
        return plan
    last = {step.ref: i for i, step in enumerate(plan.steps) if step.kind != "form_canonical"}
    for ref, (stretch, _) in zip(plan.order[:held], memo.stretches[1:], strict=True):
        if ref not in last or stretch[0] != ref or stretch[2] != plan.steps[last[ref]].state.digest:
            return plan  # a chunk before the tail changed: the tail's KV no longer follows from them
    first = last.get(plan.order[held])
    run = _run(plan.steps, first, gaps) if first is not None else None
    steps = list(plan.steps)
    if run is None or [steps[i].ref for i in run] != list(plan.order[held : held + len(run)]):
        return plan
    chunks = [plan.chunks.get(steps[i].ref) or state.entries[steps[i].ref].chunk for i in run]
    reused = _matched(memo.tail, chunks)
    if not reused:
        return plan
    left, total = reused, sum(chunk.num_tokens for chunk in chunks)
    for i, chunk in zip(run, chunks, strict=True):
        taken, step = min(left, chunk.num_tokens), steps[i]
        left -= taken
        if taken:
            forwards = int(i == run[0] and reused < total)
            detail = f"{step.detail}; {taken} of its tokens reused from the last answer's cache"
            steps[i] = replace(step, tokens=step.tokens - taken, forwards=forwards, detail=detail)
    return plan.changed(steps=tuple(steps), tail=reused)


def rest_after(chunks: Sequence[Chunk], reused: int, start: int) -> tuple[list[Chunk], int]:
    """The run's tokens after its first ``reused`` (the chunk they end inside is cut there: a
    text chunk, one position per token), and the position the first of them starts at, the run
    starting at ``start``."""
    for i, chunk in enumerate(chunks):
        if reused < chunk.num_tokens:
            if not reused:
                return list(chunks[i:]), start
            return [_after(chunk, reused), *chunks[i + 1 :]], start + reused
        reused -= chunk.num_tokens
        start += chunk.advance
    return [], start


def _run(steps: Sequence[Step], index: int, gaps: bool) -> list[int] | None:
    """Where the formations are that the executor runs in one forward from ``steps[index]``, or
    ``None`` where that is not an in-window formation of consecutive chunks (placed chunks
    between members sit before them in the cache: the tail's slots would not be theirs)."""
    first = steps[index]
    if first.kind != "form_patch" or first.off_window or first.in_run:
        return None
    run, between = [index], False
    for i in range(index + 1, len(steps)):
        step = steps[i]
        if step.kind == "form_patch" and step.in_run:
            if between:
                return None
            run.append(i)
        elif step.kind == "form_canonical":
            continue
        elif step.kind != "form_patch" and gaps:
            between = True
        else:
            break
    return run


def _matched(tail: torch.Tensor, chunks: Sequence[Chunk]) -> int:
    """How many leading tokens of the chunks' text (up to the first image) repeat ``tail``."""
    text = []
    for chunk in chunks:
        if chunk.has_vision:
            break
        text.append(chunk.input_ids)
    if not text:
        return 0
    ids = torch.cat(text)
    n = min(int(ids.shape[0]), int(tail.shape[0]))
    differ = torch.nonzero(ids[:n] != tail[:n])
    return int(differ[0, 0]) if differ.numel() else n


def _after(chunk: Chunk, reused: int) -> Chunk:
    """A text chunk's tokens after its first ``reused``: a piece to prefill, keyed apart."""
    relative = chunk.relative_positions[..., reused:]
    return replace(
        chunk,
        key=f"{chunk.key}[{reused}:]",
        input_ids=chunk.input_ids[reused:],
        relative_positions=relative - relative[..., :1],
        advance=chunk.advance - reused,
        mm_token_type_ids=chunk.mm_token_type_ids[reused:],
        label=None,
    )
