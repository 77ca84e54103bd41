"""Each window op's arguments, parsed and checked once, as the planner call the op makes.

Why one builder per op: an op and its dry run must plan the same thing. Each method here reads
what a user passed (items become chunks, refs are checked, counts validated) and returns the
op's `Build`; `KameraWindow` executes it (`OpRunner.transact`) and the dry-run view
(`window.plan.<op>`) only plans it. Nothing here runs the model or changes the window.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from kamera_agent.chunks.chunk import Chunk, ChunkKind
from kamera_agent.chunks.sources import ChannelOrder
from kamera_agent.errors import (
    ContextOverflowError,
    DuplicateChunkError,
    LargeChunkWarning,
    SettingsError,
    UnknownChunkError,
    WindowError,
)
from kamera_agent.window.conversation import MessagePart
from kamera_agent.window.runner import Build, OpRunner
from kamera_agent.window.setup import Item, chunk_of
from kamera_agent.window.state import ChunkRef, Entry

__all__ = ["OpBuilders"]


class OpBuilders:
    """The window's ops as planner calls over the runner's current state."""

    def __init__(self, runner: OpRunner) -> None:
        self.runner = runner

    # -- ops ---------------------------------------------------------------------------------
    def push(
        self,
        item: Item,
        *,
        label: str | None = None,
        kind: ChunkKind | None = None,
        caption: str | None = None,
        channel_order: ChannelOrder | None = None,
    ) -> Build:
        chunk = self.chunk(item, kind, caption, channel_order, label)
        return lambda planner: planner.push(self.runner.state, chunk, label)

    def extend(self, items: Sequence[Item], *, labels: Sequence[str | None] | None = None) -> Build:
        chunks = self.labelled(items, labels)
        return lambda planner: planner.extend(self.runner.state, chunks)

    def replace(
        self,
        ref: ChunkRef,
        item: Item,
        *,
        label: str | None = None,
        kind: ChunkKind | None = None,
        caption: str | None = None,
        channel_order: ChannelOrder | None = None,
        append: Sequence[Item] = (),
        append_labels: Sequence[str | None] | None = None,
    ) -> Build:
        self.in_window(ref)
        chunk = self.chunk(item, kind, caption, channel_order, label)
        extra = self.labelled(append, append_labels) if append else []
        return lambda planner: planner.replace(self.runner.state, ref, chunk, label, extra)

    def reorder(self, refs: Sequence[ChunkRef]) -> Build:
        return lambda planner: planner.reorder(self.runner.state, refs)

    def slide(self, n: int = 1) -> Build:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise WindowError(f"slide needs an int n >= 0, got {n!r}")
        return lambda planner: planner.remove(self.runner.state, self.runner.state.order[:n], "slide")

    def evict(self, ref: ChunkRef, *more: ChunkRef) -> Build:
        refs = [ref, *more]
        if len(set(refs)) != len(refs):
            raise DuplicateChunkError("evict names a chunk twice; name each chunk once")
        for each in refs:
            self.in_window(each)
        return lambda planner: planner.remove(self.runner.state, refs, "evict")

    def recall(self, ref: ChunkRef, at: int | None = None) -> Build:
        return lambda planner: planner.recall(self.runner.state, ref, at)

    def message(
        self,
        role: str,
        content: str | Sequence[MessagePart],
        *,
        opened: bool = True,
        closed: bool = True,
        labels: Sequence[str | None] | None = None,
    ) -> Build:
        """A chat message's chunks admitted at the right end (an ``extend``)."""
        conversation = self.runner.parts.conversation
        if conversation is None:
            raise SettingsError(
                "push_message frames chat messages: create the window with conversation=True or a "
                "system_prompt (a plain window is one user turn: push its parts)"
            )
        parts = [content] if isinstance(content, str) else list(content)
        chunks = conversation.message(role, parts, opened=opened, closed=closed, labels=labels)
        labelled = [(self.check_size(chunk), chunk.label) for chunk in chunks]
        return lambda planner: planner.extend(self.runner.state, labelled)

    # -- reading what a user passed ------------------------------------------------------------
    def labelled(
        self, items: Sequence[Item], labels: Sequence[str | None] | None
    ) -> list[tuple[Chunk, str | None]]:
        names = list(labels) if labels is not None else [None] * len(items)
        if len(names) != len(items):
            raise WindowError(f"got {len(items)} items but {len(names)} labels; give one label per item")
        return [(self.chunk(item, label=name), name) for item, name in zip(items, names, strict=True)]

    def chunk(
        self,
        item: Item,
        kind: ChunkKind | None = None,
        caption: str | None = None,
        channel_order: ChannelOrder | None = None,
        label: str | None = None,
    ) -> Chunk:
        """The item as a chunk this window can hold (`chunk_of`, then `check_size`)."""
        parts = self.runner.parts
        max_pixels = parts.config.max_image_pixels
        return self.check_size(chunk_of(parts.encoder, item, kind, caption, channel_order, label, max_pixels))

    def check_size(self, chunk: Chunk) -> Chunk:
        """Refuse a chunk the model's context cannot hold at all (every later ask would fail, and
        its prefill alone could exhaust memory); warn above ``config.large_chunk_tokens``."""
        core, config = self.runner.parts.core, self.runner.parts.config
        limit = core.backend.context_limit
        needed = core.anchor.advance + chunk.advance + 1
        if limit is not None and needed > limit:
            raise ContextOverflowError(
                f"a chunk of {chunk.num_tokens} tokens ({chunk.advance} positions) cannot fit the model's "
                f"context of {limit} with the anchor ({core.anchor.advance}) and one query token; "
                "split or shorten it"
            )
        large = config.large_chunk_tokens
        if large is not None and chunk.num_tokens > large:
            warnings.warn(
                f"a chunk of {chunk.num_tokens} tokens (over large_chunk_tokens={large}): its prefill is "
                "slow and its KV large; split it, or raise WindowConfig.large_chunk_tokens",
                LargeChunkWarning,
                stacklevel=5,
            )
        return chunk

    def entry(self, ref: ChunkRef) -> Entry:
        """The window's record of ``ref``, or `UnknownChunkError`."""
        if not isinstance(ref, ChunkRef):
            raise UnknownChunkError(f"expected a ChunkRef from this window, got {type(ref).__name__}")
        entry = self.runner.state.entries.get(ref)
        if entry is None:
            raise UnknownChunkError(
                f"{ref} does not belong to this window (another window's or branch's ref, or forgotten)"
            )
        return entry

    def in_window(self, ref: ChunkRef) -> ChunkRef:
        """``ref``, if it is in the window (not evicted), else `UnknownChunkError`."""
        if not self.entry(ref).in_window:
            raise UnknownChunkError(f"{ref} is not in the window (evicted); recall it first")
        return ref
