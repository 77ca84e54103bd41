"""Where each prompt token of a request came from: usage that adds up and tells the truth.

Why per token: ``cached_tokens`` alone hides how a token was served. A request's prompt (the
anchor, every chunk, the question) is split by provenance, and the parts add up to
``prompt_tokens``:

    prefix     the unchanged leading run: the same chunks at the same places in the same states,
               and after it what the last decode fed there that the request repeats (the last
               question's closing and its answer: a prefix cache's reply blocks)
    relocated  moved, served exactly by rotation (its state unchanged and exact)
    patched    served exactly from the store in another state (a stored patch or full KV)
    kept       served approximately with no forward (a survivor keeping what it absorbed from a
               chunk that left, an orbit patch, a recall in its earlier context, a revert)
    prefilled  computed by a forward of this request (new content, re-formed chunks, the query)

``cached_tokens`` is what no forward of this request computed (prompt − prefilled). A request
can also spend forwards on tokens that are not in its prompt (re-forming a recalled chunk's
earlier context, a cascade): ``tokens_prefilled`` counts every prompt-side token a forward of
the request processed, and may exceed ``prompt_tokens``; then the request says so.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import asdict, dataclass, field

from kamera_agent.results import Plan
from kamera_agent.window import ChunkRef, KameraWindow

__all__ = ["PromptSplit", "Provenance"]


@dataclass(frozen=True)
class PromptSplit:
    """A request's prompt tokens by where they came from (they add up to the prompt)."""

    prefix: int = 0
    relocated: int = 0
    patched: int = 0
    kept: int = 0
    prefilled: int = 0

    @property
    def total(self) -> int:
        return self.prefix + self.relocated + self.patched + self.kept + self.prefilled

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class Provenance:
    """What a window held before a request, and which of its chunks the request's forwards made.

    Made before the request's first op (`of`); shown every executed plan (`saw`); asked for the
    split after the answer (`split`).
    """

    before: dict[ChunkRef, tuple[int, str]]
    new_window: bool
    formed: dict[Hashable, int] = field(default_factory=dict)
    """Each chunk a forward made: the tokens of it the forwards computed (fewer than its own
    where it reused the last decode's tokens, `kamera_agent.window.tail`)."""

    @classmethod
    def of(cls, window: KameraWindow) -> Provenance:
        before = {ref: (i, window.state_of(ref).digest) for i, ref in enumerate(window.refs)}
        return cls(before, new_window=not window.stats.ops)

    def saw(self, plan: Plan | None) -> None:
        """An op's executed edits: chunks whose KV a forward made now."""
        if plan is None:
            return
        for edit in plan.edits:
            if edit.ref is not None and (edit.tokens or edit.kind == "form_patch"):
                self.formed[edit.ref] = self.formed.get(edit.ref, 0) + edit.tokens

    def split(self, window: KameraWindow, query_tokens: int) -> PromptSplit:
        """The window's prompt (anchor, chunks, then ``query_tokens``) by provenance."""
        counts = {"prefix": 0, "relocated": 0, "patched": 0, "kept": 0, "prefilled": query_tokens}
        counts["prefilled" if self.new_window else "prefix"] += window.encoder.anchor().num_tokens
        leading = True
        for index, ref in enumerate(window.refs):
            state, tokens = window.state_of(ref), window.chunk(ref).num_tokens
            was = self.before.get(ref)
            leading = leading and was == (index, state.digest) and ref not in self.formed
            if leading:
                kind = "prefix"
            elif ref in self.formed:  # a forward's, but the last decode's tokens it reused
                computed = min(tokens, self.formed[ref])
                counts["prefilled"] += computed
                kind, tokens = "prefix", tokens - computed
            elif not state.exact:
                kind = "kept"
            elif was is not None and was[1] == state.digest:
                kind = "relocated"
            else:
                kind = "patched"
            counts[kind] += tokens
        return PromptSplit(**counts)
