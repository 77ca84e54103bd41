"""The backend seam: the few primitives an inference engine gives kamera-agent, each with its cost.

Why this small: everything that is not engine-specific (store lookups, origin checks, the
position-free form, device moves, cost accounting) lives once above this seam, in
`kamera_agent.core`. A backend knows one engine and offers:

    prefill        chunks' tokens at given positions over given placed KV -> each chunk's KV
    encode_vision  a chunk's pixels -> the vision tower's outputs (VLMs)
    assemble       placed KV back to back -> the engine's own cache (or onto one, with crop)
    decode         a query over an assembled cache -> an answer
    recompute      (optional) chosen tokens of a placed chunk, again over a context -> its new KV
    deviation      (optional) a cheap partial forward -> how far each token's reused KV is off

plus its `KVLayout` (the KV layout and the rotary spec), its model fingerprint, the
`ChunkEncoder` that prepares chunks for its model, where it runs (device, dtype) and its context
limit. Every primitive returns what it spent (`Spent`), so costs are read from results, never
inferred from side effects. Checks against the engine's own full forward are optional
(`reference_prefill` raises `CapabilityError` where an engine has none), not part of the contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kamera_agent.backends.decode_config import Constraint, DecodeConfig
from kamera_agent.backends.held import held_bytes
from kamera_agent.backends.runs import PlacedChunk, PrefillRun, check_depth, check_indices
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.errors import CapabilityError
from kamera_agent.operator.layout import ChunkKV, KVLayout
from kamera_agent.results import Answer

__all__ = [
    "Answer",
    "Backend",
    "Capabilities",
    "Constraint",
    "DecodeConfig",
    "Decoded",
    "Deviation",
    "Prefilled",
    "Reference",
    "Spent",
    "VisionFeatures",
    "VisionOutput",
]

VisionFeatures = Mapping[str, torch.Tensor]
"""A vision tower's outputs for one chunk: ``"embeds"`` ``[n_image_tokens, hidden]`` and any
engine extras (Qwen3-VL's ``"deepstack.i"``), all belonging to the chunk itself."""


@dataclass(frozen=True)
class Spent:
    """What one primitive call cost the engine.

    Attributes:
        forwards: language-model forwards.
        tokens_prefilled: tokens those forwards processed (decode steps included).
        vision_encodes: vision-tower runs.
        decode_steps: tokens generated one forward at a time.
    """

    forwards: int = 0
    tokens_prefilled: int = 0
    vision_encodes: int = 0
    decode_steps: int = 0

    def __add__(self, other: Spent) -> Spent:
        return Spent(
            self.forwards + other.forwards,
            self.tokens_prefilled + other.tokens_prefilled,
            self.vision_encodes + other.vision_encodes,
            self.decode_steps + other.decode_steps,
        )


@dataclass(frozen=True)
class Prefilled:
    """Each prefilled chunk's KV, placed at the positions it was computed at, and the cost.

    ``cache``: with ``supports_extend``, the engine cache the forward ran over, now holding the
    context and the prefilled chunks: a window retains it for its next answer (``None`` elsewhere)."""

    kv: tuple[ChunkKV, ...]
    spent: Spent
    cache: Any = None


@dataclass(frozen=True)
class VisionOutput:
    """The vision tower's outputs for one chunk and what running it cost."""

    features: VisionFeatures
    spent: Spent


@dataclass(frozen=True)
class Decoded:
    """An answer and what decoding it cost (the query's prefill included)."""

    answer: Answer
    spent: Spent


@dataclass(frozen=True)
class Deviation:
    """How far a placed chunk's reused KV is from what its context gives, token by token.

    Attributes:
        scores: ``[n]`` float32, each token's relative L2 deviation at ``layer``: the norm of
            (fresh - reused) over both cache slots (keys and values; MLA: latent and k_pe) divided
            by the fresh rows' norm.
        layer: the decoder layer whose KV was compared (the one the partial forward's layers feed).
        spent: the partial forward (see `Backend.deviation`).
    """

    scores: torch.Tensor
    layer: int
    spent: Spent


@dataclass(frozen=True)
class Reference:
    """The engine's own full forward over ``anchor + chunks (+ query)``: the ground truth.

    Attributes:
        kv: the anchor's and every chunk's KV as that forward computed it, anchor first.
        logits: ``[vocab]`` next-token logits at the last position.
    """

    kv: tuple[ChunkKV, ...]
    logits: torch.Tensor


@dataclass(frozen=True)
class Capabilities:
    """What an engine offers beyond the primitives every engine has (all off by default).

    Attributes:
        vision: a vision tower (`Backend.encode_vision`).
        mla: MLA models (DeepSeek-V2/V3's latent plus rope band).
        extend: `Backend.assemble` onto a retained cache, `Backend.crop` and `Backend.read_slots`;
            `Backend.decode` leaves what it fed (the query, the answer tokens fed back) in the cache.
        gaps: `Backend.prefill` with ``starts`` and ``sees`` (placed chunks between a run's members).
        recompute: `Backend.recompute` and `Backend.deviation` (selective token recompute).
    """

    vision: bool = False
    mla: bool = False
    extend: bool = False
    gaps: bool = False
    recompute: bool = False


class Backend(ABC):
    """One inference engine behind a handful of primitives that report their own costs.

    Attributes:
        layout: the model's KV layout and rotary spec, handed to the operator.
        fingerprint: identity of the model's architecture and weights (store entries carry it).
        encoder: prepares chunks (tokens, pixels, positions, content keys) for this model.
    """

    layout: KVLayout
    fingerprint: str
    encoder: ChunkEncoder

    capabilities: Capabilities = Capabilities()
    """What the engine offers beyond the primitives (set by each engine; read through the
    ``supports_*`` properties where each matters)."""

    @property
    def supports_vision(self) -> bool:
        """Whether `encode_vision` runs a vision tower (image chunks can be admitted)."""
        return self.capabilities.vision

    @property
    def supports_mla(self) -> bool:
        """Whether the engine runs MLA models (a latent plus a rope band, DeepSeek-V2/V3): the
        core refuses an MLA layout on an engine that does not (`UnsupportedModelError`)."""
        return self.capabilities.mla

    @property
    def supports_extend(self) -> bool:
        """`assemble` can append onto an assembled cache and `crop` can cut one back: a window
        then reuses its assembled cache across answers for the chunks that did not move."""
        return self.capabilities.extend

    @property
    def supports_gaps(self) -> bool:
        """`prefill` takes ``starts`` and ``sees``: formations with placed chunks between them (a
        replacement mid-window and new chunks at the end) then share one forward."""
        return self.capabilities.gaps

    @property
    def supports_recompute(self) -> bool:
        """`recompute` refreshes chosen tokens of a placed chunk over its context and `deviation`
        says which tokens need it most: cross-chunk conditioning restored without a patch and
        without prefilling the whole chunk (CacheBlend-style)."""
        return self.capabilities.recompute

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the engine holds KV: store entries are moved here before use."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The KV dtype the engine computes in."""

    @property
    def context_limit(self) -> int | None:
        """The most positions a sequence may use (``None``: no known limit)."""
        return None

    def prefill(
        self,
        chunks: Sequence[Chunk],
        context: Sequence[ChunkKV],
        start: int,
        vision: Sequence[VisionFeatures] = (),
        onto: Any | None = None,
        *,
        starts: Sequence[int] | None = None,
        sees: Sequence[int] | None = None,
    ) -> Prefilled:
        """Run ``chunks``' tokens, placed back to back from position ``start``, over ``context``.

        Args:
            chunks: consecutive chunks; each is conditioned on ``context`` and the chunks before it.
            context: placed KV already in the cache, back to back (the anchor first, or empty).
            start: the position of the first chunk's first token.
            vision: the vision outputs of the chunks that have vision, in order.
            onto: with ``supports_extend``: an assembled cache that holds what comes before
                ``context`` (extended in place: the forward appends to it, nothing is copied).
            starts: with ``supports_gaps``: each chunk's first position (instead of back to back).
            sees: with ``supports_gaps``: for each chunk, how many leading cache slots (``onto``
                then ``context``) it attends to; it always sees the run's earlier chunks.

        Returns:
            Each chunk's KV at the positions it was computed at, and the cost (one forward).
        """
        run = PrefillRun.of(chunks, start, vision, starts=starts, sees=sees)
        return self.prefill_run(run, self.assemble(context, onto))

    def prefill_run(self, run: PrefillRun, cache: Any) -> Prefilled:
        """The forward behind `prefill`: ``run``'s tokens appended to ``cache`` (the context
        assembled, onto ``onto``), each chunk's KV read back at its positions; one forward.

        An engine implements this; a backend wrapping another implements `prefill` whole.
        """
        raise NotImplementedError(f"{type(self).__name__} implements neither prefill nor prefill_run")

    def encode_vision(self, chunk: Chunk) -> VisionOutput:
        """Run the vision tower on a chunk's pixels."""
        raise CapabilityError(f"{type(self).__name__} has no vision tower; push text chunks only")

    @abstractmethod
    def assemble(self, placed: Sequence[ChunkKV], onto: Any | None = None) -> Any:
        """The engine's cache holding ``placed`` back to back (each already at its positions),
        appended to ``onto`` (an assembled cache, extended in place) where the engine can."""

    def cache_nbytes(self, cache: Any) -> int:
        """Bytes an assembled ``cache`` holds, spare capacity included: what dropping it frees
        (a server bounds its windows' caches by this)."""
        return held_bytes(cache)

    def crop(self, cache: Any, slots: int) -> Any:
        """``cache`` cut back to its first ``slots`` cache slots (engines with ``supports_extend``)."""
        raise CapabilityError(f"{type(self).__name__} cannot crop an assembled cache; assemble a new one")

    def read_slots(
        self, cache: Any, start: int, positions: Sequence[torch.Tensor], keys: Sequence[str]
    ) -> list[ChunkKV]:
        """Consecutive chunks' KV copied out of an assembled ``cache`` from slot ``start``, one per
        ``positions`` (its token count) and key, placed there (engines with ``supports_extend``):
        the slots a decode filled are then chunks' KV, as a forward's output is."""
        raise CapabilityError(f"{type(self).__name__} cannot read an assembled cache's slots")

    @abstractmethod
    def decode(self, cache: Any, query_ids: torch.Tensor, start: int, config: DecodeConfig) -> Decoded:
        """Answer ``query_ids`` placed at ``start`` over ``cache`` (which it may consume; with
        ``supports_extend`` it appends to it what it fed, the query and the answer tokens)."""

    def recompute(
        self,
        chunk: Chunk,
        kv: ChunkKV,
        indices: torch.Tensor,
        context: Sequence[ChunkKV],
        start: int,
        vision: VisionFeatures | None = None,
    ) -> Prefilled:
        """``kv`` with the rows of the tokens at ``indices`` recomputed, at every layer, over ``context``.

        One forward whose queries are only the selected tokens (at their own positions, image
        tokens with their vision outputs). At each layer they attend to ``context``'s KV, then to
        the chunk's KV at that layer with their own rows replaced by what this forward computes,
        causally by slot. The other tokens keep their reused rows: what they encode is not
        changed, only what the selected tokens encode is. Recomputing every token is exactly
        ``prefill([chunk], context, start, vision)``.

        Args:
            chunk: the chunk ``kv`` belongs to.
            kv: its current KV, placed at ``chunk.positions_at(start)``.
            indices: ``[m]`` long, sorted distinct token indices within the chunk.
            context: placed KV before the chunk, back to back (the anchor first), as `prefill`.
            start: the chunk's first position.
            vision: the chunk's vision outputs, when it has vision.

        Returns:
            The new KV (one entry) and its cost: one forward of ``m`` tokens (none for ``m = 0``).

        Raises:
            CapabilityError: the engine has no selective recompute (`supports_recompute`).
        """
        self.check_recompute()
        indices = check_indices(indices, chunk.num_tokens)
        placed = PlacedChunk.checked(chunk, kv, context, start, vision, self.layout)
        if not indices.numel():
            return Prefilled((kv,), Spent())
        return self.recompute_run(placed, indices)

    def deviation(
        self,
        chunk: Chunk,
        kv: ChunkKV,
        context: Sequence[ChunkKV],
        start: int,
        vision: VisionFeatures | None = None,
        layers: int = 1,
    ) -> Deviation:
        """How far each of the chunk's tokens' reused KV is from what ``context`` gives it.

        A partial forward of all the chunk's tokens over ``context``: the first ``layers``
        decoder layers, then the KV projection of layer ``layers``, compared with ``kv`` there.
        Layer 0's KV is a function of the token alone (no context reaches it), so the first layer
        that can deviate is layer 1: ``layers = 1`` is the cheapest useful probe (CacheBlend's).

        Cost: one (partial) forward; ``tokens_prefilled = ceil(n * layers / num_layers)``, the
        full-forward tokens the partial one is worth (the last layer's projection not counted).

        Raises:
            CapabilityError: the engine has no selective recompute (`supports_recompute`).
            SettingsError: ``layers`` is not in ``[1, num_layers)``.
        """
        self.check_recompute()
        check_depth(layers, self.layout.num_layers)
        return self.deviation_run(PlacedChunk.checked(chunk, kv, context, start, vision, self.layout), layers)

    def check_recompute(self) -> None:
        """Refuse `recompute` and `deviation` on an engine without `supports_recompute`, saying
        what to do instead (an engine names its own reason)."""
        if not self.supports_recompute:
            raise CapabilityError(
                f"{type(self).__name__} has no selective recompute; re-prefill the chunk over its "
                "context (prefill) or use a backend with supports_recompute (TransformersBackend, "
                "TinyTorchBackend)"
            )

    def recompute_run(self, placed: PlacedChunk, indices: torch.Tensor) -> Prefilled:
        """The forward behind `recompute`: ``placed`` checked, ``indices`` checked and not empty."""
        raise NotImplementedError(f"{type(self).__name__} supports recompute but has no recompute_run")

    def deviation_run(self, placed: PlacedChunk, layers: int) -> Deviation:
        """The partial forward behind `deviation`: ``placed`` and ``layers`` checked."""
        raise NotImplementedError(f"{type(self).__name__} supports recompute but has no deviation_run")

    def reference_prefill(
        self, chunks: Sequence[Chunk], query_ids: torch.Tensor | None = None, *, anchor: Chunk | None = None
    ) -> Reference:
        """The engine's own full forward over ``anchor + chunks (+ query)``, for checks.

        Computed the way the engine serves an ordinary request (its own positions, its own vision
        path), independently of kamera's placement, so a match checks both. ``anchor``: the
        window's (a conversation's system block); default the encoder's.

        Raises:
            CapabilityError: the engine has no full forward of its own to check against.
        """
        raise CapabilityError(
            f"{type(self).__name__} offers no reference forward; check against another backend"
        )

    def reference_inputs(
        self, chunks: Sequence[Chunk], query_ids: torch.Tensor | None = None, *, anchor: Chunk | None = None
    ) -> dict[str, Any]:
        """Keyword arguments for the model's own forward over a full re-prefill (engines that have
        one); ``anchor`` as for `reference_prefill`."""
        raise CapabilityError(f"{type(self).__name__} has no model forward to build inputs for")
