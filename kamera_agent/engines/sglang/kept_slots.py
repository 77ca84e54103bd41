"""`KeptSlots`: which of the radix tree's slots hold a kept load, so an eviction can say so.

Why: a load in a state a forward would not compute (`KeptLoad`: a kept state, or a splice) is
remembered by `PrefixSynthesis` so later requests that find those tokens in the tree chain the
state they really hold. Once SGLang evicts the tokens, a later request computes them again and
holds what a forward gives; a memory that still named the load would file that exact KV under
the approximate name and chain every later chunk behind the wrong state. SGLang evicts a leaf at
a time (``RadixCache.evict`` -> ``_delete_leaf``), each node's ``value`` the slots it frees; a
node's slots outlive splits (``_split_node`` keeps the ids), so the slot ids are what a load's
tokens are known by:

    load's tokens [start, start + tokens) ──► tree slots ──► slot -> (load's prefix, offset)
    evicted leaf's slots ──► the least offset each load lost ──► `PrefixSynthesis.lost`

A leaf's ancestors are evicted after it, so a load loses a tail: the tokens before the least
offset lost are still the load's, the record keeps them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["KeptSlots"]


class KeptSlots:
    """Slot ids of the tree that hold kept loads' tokens, each with its load and offset."""

    def __init__(self) -> None:
        self._at: dict[int, tuple[str, int]] = {}  # slot -> (load's prefix, offset in its chunk)
        self._slots: dict[str, list[int]] = {}  # load's prefix -> its slots, offset order

    def __len__(self) -> int:
        """Slots that hold a kept load's tokens."""
        return len(self._at)

    def record(self, prefix: str, slots: Sequence[int]) -> None:
        """The load remembered at ``prefix`` holds its chunk's first ``len(slots)`` tokens in
        ``slots`` (the tree's slots: a load that finishes a chunk the tree began includes them)."""
        self._cut(prefix, 0)  # a load made again replaces the last one's slots
        self._slots[prefix] = list(slots)
        for offset, slot in enumerate(slots):
            self._at[slot] = (prefix, offset)

    def evicted(self, slots: Iterable[int]) -> dict[str, int]:
        """The tree freed ``slots``: each load that held one, with how many of its tokens remain."""
        lost: dict[str, int] = {}
        for slot in slots:
            hit = self._at.get(slot)
            if hit is not None:
                prefix, offset = hit
                lost[prefix] = min(offset, lost.get(prefix, offset))
        for prefix, kept_tokens in lost.items():
            self._cut(prefix, kept_tokens)
        return lost

    def clear(self) -> list[str]:
        """The tree was reset: every load is gone; returns their prefixes."""
        prefixes = list(self._slots)
        self._at.clear()
        self._slots.clear()
        return prefixes

    def _cut(self, prefix: str, kept_tokens: int) -> None:
        slots = self._slots.pop(prefix, [])
        for slot in slots[kept_tokens:]:
            if self._at.get(slot, ("", 0))[0] == prefix:
                del self._at[slot]
        if kept_tokens > 0 and slots:
            self._slots[prefix] = slots[:kept_tokens]
