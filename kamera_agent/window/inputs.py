"""Reading what a user passes to a window op: items become chunks, refs are checked.

Why apart: every op reads items and refs the same way (`chunk_of`, then the context-limit and
size checks; a ref known to this window, in it or evicted), and a dry run must read them exactly
as the op does, which it does by running the op itself (`window.plan`). Nothing here runs the
model or changes the window.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from kamera_agent.chunks.chunk import Chunk, ChunkKind
from kamera_agent.chunks.sources import ChannelOrder
from kamera_agent.errors import (
    ArgumentError,
    ContextOverflowError,
    LargeChunkWarning,
    SettingsError,
    UnknownChunkError,
)
from kamera_agent.window.arguments import check_items, check_labels, check_text
from kamera_agent.window.conversation import Conversation
from kamera_agent.window.runner import OpRunner
from kamera_agent.window.setup import Item, chunk_of
from kamera_agent.window.state import ChunkRef, Entry

__all__ = ["Inputs"]


class Inputs:
    """What a user passes to a window's ops, read against the runner's current state."""

    def __init__(self, runner: OpRunner) -> None:
        self.runner = runner

    def conversation(self) -> Conversation:
        """The window's chat framing, or `SettingsError` for a window of one user turn."""
        conversation = self.runner.parts.conversation
        if conversation is None:
            raise SettingsError(
                "push_message frames chat messages: create the window with conversation=True or a "
                "system_prompt (a plain window is one user turn: push its parts)"
            )
        return conversation

    def labelled(
        self, items: Sequence[Item], labels: Sequence[str | None] | None
    ) -> list[tuple[Chunk, str | None]]:
        items = check_items(items, "items")
        names = check_labels(labels, len(items))
        return [
            (self.item(item, None, None, None, name), name) for item, name in zip(items, names, strict=True)
        ]

    def item(
        self,
        item: Item,
        kind: ChunkKind | None,
        caption: str | None,
        order: ChannelOrder | None,
        label: str | None,
    ) -> Chunk:
        """The item as a chunk this window can hold: `chunk_of`, then `check_size`."""
        check_text(caption, "caption", optional=True)
        check_text(label, "label", optional=True)
        if order is not None and order not in ("rgb", "bgr"):
            raise ArgumentError(f"channel_order must be 'rgb', 'bgr' or None, got {order!r}")
        parts = self.runner.parts
        max_pixels = parts.config.max_image_pixels
        return self.check_size(chunk_of(parts.encoder, item, kind, caption, order, label, max_pixels))

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
                stacklevel=4,
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
