"""Vouching without an audit: a kept state's drift bounded from what is known before any forward.

Why: an engine adapter cannot recompute a chunk's tokens to audit a kept state, and under
``vllm serve`` no window runs to audit for it, so a budget that needs an audit serves nothing
kept. What is known at plan time, in an engine as in a window, is where the chunk sits and what
its KV absorbed: how far it is from the first chunk served in a state other than the one a
re-prefill computes (its **distance**), and whether every chunk its KV encodes is still in the
context (a reordered chunk's) or some are **gone** (a slide's, an eviction's survivors: they
still carry what left). `kamera calibrate` measures, on its own episodes, every approximated
chunk's true error with these two facts, and files per class and distance a conservative bound
(`Calibration.vouch_bounds`: the calibration's quantile of the true errors there, made
non-increasing with distance), the default ε the bound may serve within
(`Calibration.vouch_budget`: the largest of `BUDGETS` up to which the episodes' ops whose every
chunk the bounds put within it answered like a re-prefill, and were enough to show it), and
nothing else: where no bound was fitted, only an audit vouches.
"""

from __future__ import annotations

from collections.abc import Collection

from kamera_agent.core.identity import ChunkState, Context

__all__ = ["CLASSES", "DISTANCES", "WALK", "absorbed_gone", "vouch_class"]

CLASSES = ("present", "gone")
"""A kept state's class: every chunk its KV encodes is still in the context, or some are gone."""

DISTANCES = 8
"""Distances a bound is fitted for; the last one's bound holds for every farther chunk."""


WALK = 4096
"""The most antecedent states `absorbed_gone` reads: a kept state's chain reaches back through
every state it was captured behind, which a long conversation lengthens, and an engine plans
with it per request; past this many it answers as if something were gone (never served on it)."""


def absorbed_gone(
    state: ChunkState, present: Collection[str], left: Context | None = None, limit: int = WALK
) -> bool:
    """Whether ``state``'s KV, served behind ``left``, encodes a chunk whose key is not in
    ``present``: through its context, its antecedents' own contexts and a recomputed state's
    source, all the way back. An orbit state encodes the set of chunks behind it (it is served
    only where that set is the one it averages over: equal keysets), so it is read as that set;
    an orbit whose set is not what stands behind it, or a splice (its tail's context is folded
    into its digest), names no chunks and counts as encoding something gone; so does a chain of
    more than ``limit`` states."""
    seen: set[str] = set()
    pending: list[tuple[ChunkState, Context | None]] = [(state, left)]
    while pending:
        current, behind = pending.pop()
        contexts = [current.context]
        if current.kind == "spliced":
            return True
        if current.kind == "orbit" and current.members:
            if behind is None or behind.keyset != current.keyset:
                return True
            contexts = [behind]
        if current.source is not None:
            pending.append((current.source, current.context))
        for context in contexts:
            node: Context | None = context
            while node is not None and node.last is not None:
                antecedent, node = node.last, node.parent
                if antecedent.digest in seen:
                    continue
                seen.add(antecedent.digest)
                if antecedent.chunk_key not in present or len(seen) > limit:
                    return True
                pending.append((antecedent, node))
    return False


def vouch_class(state: ChunkState, present: Collection[str], left: Context | None = None) -> str:
    """The class of `CLASSES` ``state`` is bounded by behind ``left``, in a context holding ``present``."""
    return "gone" if absorbed_gone(state, present, left) else "present"
