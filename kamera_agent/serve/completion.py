"""A served request as the OpenAI wire format sees it: its answers, tool calls and true usage.

Why apart from the server: the server decides what a request does; this says what it did, in
the shapes both APIs return (chat completions, and the Responses API built on them): each
choice's message, finish reasons, ``usage`` whose cached tokens no forward computed, and the
``kamera`` object listing every op and its cost.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from kamera_agent.results import Answer, OpCost, Plan
from kamera_agent.serve.sync import SyncReport
from kamera_agent.serve.timing import Clock
from kamera_agent.serve.tools import ToolFormat
from kamera_agent.serve.usage import PromptSplit

__all__ = ["Called", "Completion", "called", "logprobs_of"]


@dataclass(frozen=True)
class Called:
    """An answer read for tool calls: the text around them, and the calls in OpenAI's shape."""

    content: str | None
    tool_calls: list[dict[str, Any]]


@dataclass(frozen=True)
class Completion:
    """A served request: the answer, its session, what it did and its usage."""

    id: str
    created: int
    model: str
    session_id: str
    answer: Answer
    report: SyncReport
    split: PromptSplit
    tokens_prefilled: int
    more: tuple[Answer, ...] = ()
    """Choices 1.. of a request with ``n > 1`` (choice 0 is ``answer``, the one the session keeps)."""
    logprobs: tuple[dict[str, Any] | None, ...] = ()
    """Each choice's ``logprobs`` object in OpenAI's shape (``None``: not asked for)."""
    calls: tuple[Called, ...] = ()
    """Each choice's text read for tool calls (empty when the request gave no tools)."""
    drift: dict[str, float | None] = field(default_factory=dict)
    """The session's drift budget and the largest estimated drift of any chunk its answer read
    (`KameraWindow.drift_of`; ``None``: some chunk is approximated with no budget to estimate it)."""
    waited: int = 0
    """Decode steps of other requests that ran while this one waited for the model."""
    clock: Clock = field(default_factory=Clock)
    """When the request arrived, waited, began answering and ended (the latency histograms')."""

    def message(self, index: int) -> dict[str, Any]:
        """Choice ``index``'s assistant message: its content, and its tool calls if it made any."""
        answer = self.answers[index]
        if not self.calls or not self.calls[index].tool_calls:
            return {"role": "assistant", "content": answer.text}
        called = self.calls[index]
        return {"role": "assistant", "content": called.content, "tool_calls": called.tool_calls}

    @property
    def answers(self) -> tuple[Answer, ...]:
        return (self.answer, *self.more)

    @property
    def prompt_tokens(self) -> int:
        return self.split.total

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens no forward of this request computed (never clamped: the split adds up)."""
        return self.prompt_tokens - self.split.prefilled

    @property
    def finish_reason(self) -> str:
        return _finish(self.answer)

    def finish_reasons(self) -> list[str]:
        called = self.calls or (None,) * len(self.answers)
        return [
            "tool_calls" if call is not None and call.tool_calls else _finish(answer)
            for answer, call in zip(self.answers, called, strict=True)
        ]

    def usage(self) -> dict[str, Any]:
        completion = sum(len(answer.tokens) for answer in self.answers)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def kamera(self) -> dict[str, Any]:
        """The extension object: the session, the prompt's provenance, every op the request ran
        and what each cost, and the forward work beyond the prompt, if any."""
        edits = [_edits(plan) for plan in self.report.plans] + [{}] * len(self.answers)
        ran = [*self.report.ops, *(("ask", [], answer.cost or OpCost()) for answer in self.answers)]
        ops = [
            {"op": op, "chunks": labels, "edits": done, **_cost(cost)}
            for (op, labels, cost), done in zip(ran, edits, strict=True)
        ]
        return {
            "session_id": self.session_id,
            "prompt": self.split.as_dict(),
            "ops": ops,
            "prefilled_prompt_tokens": self.split.prefilled,
            "tokens_prefilled": self.tokens_prefilled,
            "beyond_prompt": max(0, self.tokens_prefilled - self.prompt_tokens),
            "drift": self.drift,
            "waited_decode_steps": self.waited,
        }


def logprobs_of(answer: Answer, tokenizer: Any) -> dict[str, Any] | None:
    """An answer's ``logprobs`` in OpenAI's shape (each token's text, logprob, UTF-8 bytes and
    its step's most likely alternatives), or ``None`` when not asked for."""
    if answer.logprobs is None:
        return None

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(step.token, step.logprob), "top_logprobs": [entry(t, lp) for t, lp in step.top]}
            for step in answer.logprobs
        ],
        "refusal": None,
    }


def called(answer: Answer, parallel: bool, tool_format: ToolFormat) -> Called:
    """The answer's tool calls (the first only when ``parallel`` is off) and the text around them."""
    content, tool_calls = tool_format.parse(answer.text)
    return Called(content, tool_calls if parallel else tool_calls[:1])


def _finish(answer: Answer) -> str:
    """OpenAI's finish reason: ``length`` when the answer ran out of tokens, else ``stop``."""
    return "length" if answer.finish_reason == "length" else "stop"


def _edits(plan: Plan) -> dict[str, int]:
    """How many edits of each kind an op's plan executed (relocations of unmoved chunks aside)."""
    return dict(Counter(edit.kind for edit in plan.edits if edit.kind != "rotate"))


def _cost(cost: OpCost) -> dict[str, Any]:
    """Every `OpCost` field, seconds rounded to the microsecond."""
    return {**asdict(cost), "seconds": round(cost.seconds, 6)}
