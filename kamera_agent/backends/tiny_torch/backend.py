"""The plain-torch backend: the seam's primitives over `TinyRopeLM`, with no transformers at all.

Why: it proves `kamera_agent.backends.base.Backend` is an engine seam, not a transformers
wrapper. Everything engine-specific stays here: the model's interleaved rotary pairs are
described to the operator by a `RotarySpec` built from the model's own ``inv_freq``, and its
cache (per-layer ``[kv_heads, S, head_dim]``) is converted to and from ChunkKV's
``[L, H, n, D]`` by `assemble` and by reading chunks back out after a forward. The reference
forward (`reference_prefill`) is the model's single forward over the whole sequence from an
empty cache at positions ``0..N-1``, with the vision tower run inside it, so it shares no code
path with placement (``positions_at``, context caches, handed-in vision outputs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from kamera_agent.backends.base import (
    Backend,
    Capabilities,
    DecodeConfig,
    Decoded,
    Deviation,
    Prefilled,
    Reference,
    Spent,
    VisionFeatures,
    VisionOutput,
)
from kamera_agent.backends.decoding import decode_loop
from kamera_agent.backends.recompute import (
    deviation_scores,
    deviation_spent,
    recompute_hidden,
    replace_rows,
    vision_rows,
)
from kamera_agent.backends.runs import PlacedChunk, PrefillRun
from kamera_agent.backends.tiny_torch.model import TinyConfig, TinyKVCache, TinyRopeLM
from kamera_agent.backends.tiny_torch.recompute import Halted, HaltingCache, ScatterCache
from kamera_agent.backends.tiny_torch.tokenizer import TinyByteTokenizer, TinyImageProcessor
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.chunks.positions import LinearPositions
from kamera_agent.chunks.prompt import PromptFormat
from kamera_agent.errors import CapabilityError, LayoutMismatchError
from kamera_agent.fingerprint import model_fingerprint
from kamera_agent.operator.layout import ChunkKV, KVLayout, check_layout
from kamera_agent.operator.rope import RotarySpec

__all__ = ["TINY_PROMPT", "TinyTorchBackend"]

TINY_PROMPT = PromptFormat(
    anchor="<|bos|><|user|>",
    image_open="<|img_start|>",
    image_token="<|image|>",
    image_close="<|img_end|>",
    query_prefix="",
    query_suffix="<|end|><|assistant|>",
)
"""Where chunks sit in the tiny model's chat template."""


class TinyTorchBackend(Backend):
    """Backend over a seeded `TinyRopeLM`, float32 on CPU.

    Args:
        config: the model's sizes (default `TinyConfig()`).
        seed: seeds the model's weights.
    """

    def __init__(self, config: TinyConfig | None = None, seed: int = 0) -> None:
        c = self.config = config or TinyConfig()
        self.model = TinyRopeLM(c, seed=seed).eval()
        self.tokenizer = TinyByteTokenizer()
        if c.vocab_size < len(self.tokenizer):
            raise ValueError(f"vocab_size {c.vocab_size} is below the tokenizer's {len(self.tokenizer)} ids")
        self.image_processor = TinyImageProcessor(c.image_size, c.patch_size)
        self.layout = KVLayout(
            kind="mha" if c.heads == c.kv_heads else "gqa",
            num_layers=c.layers,
            keys_shape=(c.kv_heads, c.head_dim),
            values_shape=(c.kv_heads, c.head_dim),
            rope_slot="keys",
            rope=RotarySpec(inv_freq=self.model.inv_freq.detach().clone(), pairing="interleaved"),
            name="tiny-torch",
        )
        self.fingerprint = model_fingerprint(self.model)
        self.positions = LinearPositions()
        self.encoder = ChunkEncoder(
            self.tokenizer, self.image_processor, TINY_PROMPT, self.positions, self.fingerprint, merge_size=1
        )
        self.capabilities = Capabilities(vision=True, extend=True, gaps=True, recompute=True)

    # -- where it runs ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def context_limit(self) -> int | None:
        return self.config.max_positions

    # -- the seam's primitives -----------------------------------------------------------------
    def prefill_run(self, run: PrefillRun, cache: TinyKVCache) -> Prefilled:
        """One forward of ``run`` appended to ``cache``; each chunk's KV read back from its slots."""
        slot = cache.length
        embeds = self._embeds(run.input_ids, run.mm_token_type_ids, run.vision)
        with torch.no_grad():
            _, cache = self.model(embeds, torch.cat(run.positions), cache, run.hidden(slot))
        out = []
        for chunk, where in zip(run.chunks, run.positions, strict=True):
            out.append(self._read(cache, slot, chunk.num_tokens, where, chunk.key))
            slot += chunk.num_tokens
        return Prefilled(tuple(out), Spent(forwards=1, tokens_prefilled=run.tokens), cache)

    def recompute_run(self, placed: PlacedChunk, indices: torch.Tensor) -> Prefilled:
        """One forward of the selected tokens over the context and the chunk's placed KV, their
        fresh rows written into their own slots as each layer computes them (`ScatterCache`)."""
        chunk, n = placed.chunk, placed.chunk.num_tokens
        cache = self.assemble([*placed.context, placed.kv])
        cached = cache.length - n
        selected = vision_rows(placed.vision, chunk.mm_token_type_ids, indices)
        embeds = self._embeds(
            chunk.input_ids[indices], chunk.mm_token_type_ids[indices], [selected] if selected else []
        )
        slots = cached + indices
        scatter = ScatterCache(cache.keys, cache.values, slots)
        positions = chunk.positions_at(placed.start)[..., indices]
        with torch.no_grad():
            self.model(embeds, positions, scatter, recompute_hidden(cached, n, indices))
        keys = torch.stack([k[:, slots] for k in scatter.keys])  # [L, H, m, D]
        values = torch.stack([v[:, slots] for v in scatter.values])
        spent = Spent(forwards=1, tokens_prefilled=int(indices.numel()))
        return Prefilled((replace_rows(placed.kv, indices, keys, values),), spent)

    def deviation_run(self, placed: PlacedChunk, layers: int) -> Deviation:
        """The chunk's tokens through the first ``layers`` blocks over the context; the forward
        stops at layer ``layers``' KV (`HaltingCache`), which is compared with the reused KV's."""
        chunk, vision = placed.chunk, placed.vision
        cache = self.assemble(placed.context)
        probe = HaltingCache(cache.keys, cache.values, depth=layers)
        embeds = self._embeds(chunk.input_ids, chunk.mm_token_type_ids, [vision] if vision else [])
        with torch.no_grad(), contextlib.suppress(Halted):  # the probe stops the forward at ``layers``
            self.model(embeds, chunk.positions_at(placed.start), probe)
        assert probe.fresh is not None, "the partial forward never reached the probed layer"
        scores = deviation_scores(*probe.fresh, placed.kv, layers)
        return Deviation(scores, layers, deviation_spent(chunk.num_tokens, layers, self.config.layers))

    def encode_vision(self, chunk: Chunk) -> VisionOutput:
        if chunk.pixel_values is None:
            raise CapabilityError(
                "this chunk has no pixels (text, or released); its vision output must come from a store"
            )
        with torch.no_grad():
            embeds = self.model.encode_image(chunk.pixel_values)  # [n_image_tokens, hidden]
        return VisionOutput({"embeds": embeds}, Spent(vision_encodes=1))

    def assemble(self, placed: Sequence[ChunkKV], onto: Any | None = None) -> TinyKVCache:
        """A `TinyKVCache` holding ``placed`` back to back (after ``onto``'s slots):
        ``[L, H, n, D]`` -> per layer ``[H, S, D]``."""
        for kv in placed:
            if kv.positions is None:
                raise LayoutMismatchError("assemble needs placed KV (positions set); place canonicals first")
            check_layout(kv, self.layout)
        cache = onto if isinstance(onto, TinyKVCache) else TinyKVCache.empty(self.config)
        if not placed:
            return cache
        keys = torch.cat([kv.keys for kv in placed], dim=2).to(self.device, self.dtype)  # [L, H, S, D]
        values = torch.cat([kv.values for kv in placed], dim=2).to(self.device, self.dtype)
        for layer in range(self.config.layers):
            cache.append(layer, keys[layer], values[layer])
        return cache

    def crop(self, cache: Any, slots: int) -> TinyKVCache:
        if not isinstance(cache, TinyKVCache):
            raise TypeError(f"crop needs a TinyKVCache from assemble, got {type(cache).__name__}")
        cache.keys = [k[:, :slots] for k in cache.keys]
        cache.values = [v[:, :slots] for v in cache.values]
        return cache

    def read_slots(
        self, cache: Any, start: int, positions: Sequence[torch.Tensor], keys: Sequence[str]
    ) -> list[ChunkKV]:
        out, slot = [], start
        for where, key in zip(positions, keys, strict=True):
            n = int(where.shape[-1])
            out.append(self._read(cache, slot, n, where, key))
            slot += n
        return out

    def decode(self, cache: Any, query_ids: torch.Tensor, start: int, config: DecodeConfig) -> Decoded:
        if not isinstance(cache, TinyKVCache):
            raise TypeError(f"decode needs a TinyKVCache from assemble, got {type(cache).__name__}")

        def forward(ids: torch.Tensor, positions: torch.Tensor, cache: Any) -> tuple[Any, torch.Tensor]:
            with torch.no_grad():
                hidden, cache = self.model(self.model.embed(ids), positions, cache)
                return cache, self.model.logits(hidden[-1]).float()

        def detokenize(tokens: list[int]) -> str:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

        eos = {self.tokenizer.eos_token_id}
        return decode_loop(forward, self.positions.text, detokenize, eos, cache, query_ids, start, config)

    # -- checks against the model's own forward ------------------------------------------------
    def reference_prefill(
        self, chunks: Sequence[Chunk], query_ids: torch.Tensor | None = None, *, anchor: Chunk | None = None
    ) -> Reference:
        """The model's single forward over ``anchor + chunks (+ query)`` at positions ``0..N-1``
        from an empty cache, the vision tower run here on each image chunk's pixels."""
        everything = [anchor or self.encoder.anchor(), *chunks]
        tail = [] if query_ids is None else [query_ids.to(torch.long)]
        ids = torch.cat([c.input_ids for c in everything] + tail)
        with torch.no_grad():
            embeds, slot = self.model.embed(ids).clone(), 0  # [N, hidden]
            for chunk in everything:
                if chunk.has_vision:
                    if chunk.pixel_values is None:
                        raise CapabilityError(
                            "an image chunk's pixels were released; the reference needs them"
                        )
                    where = slot + torch.nonzero(chunk.mm_token_type_ids == 1).flatten()
                    embeds[where] = self.model.encode_image(chunk.pixel_values)
                slot += chunk.num_tokens
            positions = torch.arange(int(ids.shape[0]))
            hidden, cache = self.model(embeds, positions, TinyKVCache.empty(self.config))
            logits = self.model.logits(hidden[-1]).float()
        kv, slot = [], 0
        for chunk in everything:
            kv.append(
                self._read(
                    cache, slot, chunk.num_tokens, positions[slot : slot + chunk.num_tokens], chunk.key
                )
            )
            slot += chunk.num_tokens
        return Reference(tuple(kv), logits)

    # -- helpers ---------------------------------------------------------------------------------
    def _embeds(self, ids: torch.Tensor, mm: torch.Tensor, vision: Sequence[VisionFeatures]) -> torch.Tensor:
        """Token embeddings ``[n, hidden]`` with image tokens replaced by the vision outputs, in order."""
        embeds = self.model.embed(ids)
        image = mm == 1
        n_image = int(image.sum())
        given = torch.cat([f["embeds"] for f in vision]) if vision else embeds[:0]
        if int(given.shape[0]) != n_image:
            raise ValueError(
                f"the chunks hold {n_image} image tokens but the vision outputs give {int(given.shape[0])}; "
                "pass encode_vision(chunk).features for every chunk with vision, in order"
            )
        if n_image:
            embeds = embeds.clone()
            embeds[image] = given.to(embeds.dtype)
        return embeds

    def _read(self, cache: TinyKVCache, slot: int, n: int, positions: torch.Tensor, key: str) -> ChunkKV:
        """Slots ``slot .. slot + n`` of the cache as a placed ChunkKV ``[L, H, n, D]``."""
        keys = torch.stack([k[:, slot : slot + n] for k in cache.keys])
        values = torch.stack([v[:, slot : slot + n] for v in cache.values])
        return ChunkKV(keys, values, positions.clone(), chunk_key=key, model_fingerprint=self.fingerprint)
