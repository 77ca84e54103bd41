"""The transformers backend: chunks through a Hugging Face model, on CPU or GPU.

It offers the seam's primitives and nothing above them: ``prefill`` runs chunks' tokens at
given positions over an assembled ``DynamicCache`` (merging the vision outputs it is handed,
Qwen3-VL's deepstack included) and reads each chunk's KV back out; ``encode_vision`` runs the
vision tower; ``assemble`` concatenates placed KV into a ``DynamicCache``; ``decode`` answers a
query with explicit positions (M-RoPE ids included). Stores, origin checks, the position-free
form and costs live in `kamera_agent.core`. For checks it also runs the model's own full
forward (``reference_prefill``), positions computed by the model itself.
"""

from __future__ import annotations

import functools
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
from kamera_agent.backends.runs import PlacedChunk, PrefillRun
from kamera_agent.backends.transformers.cache import HEADROOM, BufferedLayer, buffered_cache
from kamera_agent.backends.transformers.families import family_of
from kamera_agent.backends.transformers.parts import ModelParts, model_parts
from kamera_agent.backends.transformers.positions import position_scheme
from kamera_agent.backends.transformers.reading import kv_layout, read_chunk, read_chunks
from kamera_agent.backends.transformers.recompute import check_supported, deviation, recompute
from kamera_agent.backends.transformers.windows import SlidingLayers, sliding_layers
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.chunks.positions import PositionScheme
from kamera_agent.chunks.prompt import PromptFormat
from kamera_agent.compat import cache_kwarg, last_logits_only, output_cache
from kamera_agent.critical_path import to_device
from kamera_agent.errors import CapabilityError, LayoutMismatchError, UnsupportedModelError
from kamera_agent.fingerprint import model_fingerprint
from kamera_agent.operator.layout import ChunkKV

__all__ = ["TransformersBackend", "eos_token_ids"]


class TransformersBackend(Backend):
    """Backend over a loaded transformers model.

    Args:
        model: a causal LM or image-text-to-text model (Qwen2/2.5/3-VL, Llama, Qwen2, DeepSeek-V2/V3 ...).
        processor: a full processor (with ``tokenizer`` and ``image_processor``), if you have one.
        tokenizer: the tokenizer, when no processor is given.
        image_processor: the image processor, when no processor is given (VLMs).
        prompt: where chunks sit in the chat template (default: read from the tokenizer's template).
        fingerprint: the model's identity in stores (default: `model_fingerprint` of its weights,
            the digest SGLang's and vLLM's adapters give the same checkpoint, so they share a store).
    """

    def __init__(
        self,
        model: Any,
        processor: Any | None = None,
        *,
        tokenizer: Any | None = None,
        image_processor: Any | None = None,
        prompt: PromptFormat | None = None,
        fingerprint: str | None = None,
    ) -> None:
        tokenizer = tokenizer or getattr(processor, "tokenizer", None)
        image_processor = image_processor or getattr(processor, "image_processor", None)
        if tokenizer is None:
            raise UnsupportedModelError("pass tokenizer= (or a processor that has one) with the model")
        family_of(model.config)  # an unknown family is named before anything else is read
        self.model = model.eval()
        self.parts: ModelParts = model_parts(model)
        self.layout = kv_layout(model)
        self.fingerprint = fingerprint or model_fingerprint(model)
        self.tokenizer = tokenizer
        image_token = _image_token(model, tokenizer) if self.parts.has_vision else None
        self.prompt = prompt or PromptFormat.from_tokenizer(tokenizer, image_token)
        merge = int(getattr(getattr(model.config, "vision_config", None), "spatial_merge_size", 1) or 1)
        self.positions: PositionScheme = position_scheme(model, self.layout.rope.is_mrope)
        self.encoder = ChunkEncoder(
            tokenizer,
            image_processor if self.parts.has_vision else None,
            self.prompt,
            self.positions,
            self.fingerprint,
            merge,
            self.parts.tokens_per_image(),
        )
        self._eos = eos_token_ids(model, tokenizer)
        # Flash-style kernels take no custom 4-D mask: formations across gaps run apart.
        gaps = getattr(model.config, "_attn_implementation", None) in MASKED_ATTENTION
        self.sliding: SlidingLayers | None = sliding_layers(model.config)
        """Where layers attend within a window: the backend masks them by position (`windows`)."""
        if self.sliding is not None:
            _check_sliding(model, gaps, self.layout.rope.is_mrope or self.parts.has_vision)
        # Recompute masks too (sliding layers by position, as every forward here).
        self.capabilities = Capabilities(
            vision=self.parts.has_vision, mla=True, extend=True, gaps=gaps, recompute=gaps
        )
        self.anchor: Chunk = self.encoder.anchor()
        """The anchor chunk every window starts with (the one the encoder gives)."""

    # -- where it runs ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.parts.device

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.dtype

    @functools.cached_property
    def context_limit(self) -> int | None:  # read once: a walk through the config, asked twice an op
        config = self.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        value = getattr(text, "max_position_embeddings", None)
        return int(value) if value else None

    # -- the seam's primitives -----------------------------------------------------------------
    def prefill_run(self, run: PrefillRun, cache: Any) -> Prefilled:
        """One forward over consecutive chunks: each chunk's KV is conditioned on what ``cache``
        holds and the exact KV of the chunks before it in the run (what a re-prefill of the run
        computes), in the time of a single prefill of the run's tokens."""
        slot = cache.get_seq_length()
        cache, _ = self.forward(
            run.input_ids,
            run.mm_token_type_ids,
            torch.cat(run.positions, dim=-1),
            cache,
            _merge_features(list(run.vision)),
            logits=False,
            hidden=run.hidden(slot),
        )
        keys = [chunk.key for chunk in run.chunks]
        out = read_chunks(
            cache, self.layout, slot, list(run.positions), keys, model_fingerprint=self.fingerprint
        )
        return Prefilled(tuple(out), Spent(forwards=1, tokens_prefilled=run.tokens), cache)

    def check_recompute(self) -> None:
        check_supported(self)

    def recompute_run(self, placed: PlacedChunk, indices: torch.Tensor) -> Prefilled:
        """The selected tokens' rows recomputed over the context (see `recompute`)."""
        return recompute(self, placed, indices)

    def deviation_run(self, placed: PlacedChunk, layers: int) -> Deviation:
        """Each token's deviation at layer ``layers`` from a partial forward (see `deviation`)."""
        return deviation(self, placed, layers)

    def encode_vision(self, chunk: Chunk) -> VisionOutput:
        if not self.parts.has_vision:
            raise CapabilityError(f"{type(self.model).__name__} has no vision tower; push text chunks only")
        if chunk.pixel_values is None:
            raise CapabilityError(
                "this chunk's pixels were released; its vision output must come from a store"
            )
        features = self.parts.image_features(chunk.pixel_values, chunk.image_grid_thw)
        return VisionOutput(features, Spent(vision_encodes=1))

    def assemble(self, placed: Sequence[ChunkKV], onto: Any | None = None) -> Any:
        """A ``DynamicCache`` of `BufferedLayer` s (appends cost the new tokens only) holding
        ``placed`` back to back, after what ``onto`` already holds."""
        cache = onto if onto is not None else self.empty_cache()
        if not placed:
            return cache
        positions = [kv.positions for kv in placed]
        if any(where is None for where in positions):
            raise LayoutMismatchError(
                "assemble needs placed KV (positions set); place canonicals with apply_patch"
            )
        if self.sliding is not None:  # the slots' positions, for the window masks
            for where in positions:
                cache.record(where)
        total = cache.get_seq_length() + sum(kv.num_tokens for kv in placed) + HEADROOM
        device = self.device
        for layer in range(self.layout.num_layers):
            pieces = [
                (to_device(kv.keys[layer][None], device), to_device(kv.values[layer][None], device))
                for kv in placed
            ]
            if isinstance(cache.layers[layer], BufferedLayer):
                cache.layers[layer].reserve(*pieces[0], total)  # one allocation, then copies in place
            else:  # a layer that concatenates: join first, so it copies once
                pieces = [(torch.cat([k for k, _ in pieces], 2), torch.cat([v for _, v in pieces], 2))]
            for keys, values in pieces:
                cache.update(keys, values, layer)
        return cache

    def crop(self, cache: Any, slots: int) -> Any:
        surplus = cache.get_seq_length() - slots
        if surplus > 0:
            cache.crop(-surplus)
        return cache

    def read_slots(
        self, cache: Any, start: int, positions: Sequence[torch.Tensor], keys: Sequence[str]
    ) -> list[ChunkKV]:
        return read_chunks(cache, self.layout, start, positions, keys, model_fingerprint=self.fingerprint)

    def empty_cache(self) -> Any:
        """An empty cache for this model whose appends cost the new tokens only."""
        return buffered_cache(self.model.config, whole_history=self.sliding is not None)

    def decode(self, cache: Any, query_ids: torch.Tensor, start: int, config: DecodeConfig) -> Decoded:
        def forward(ids: torch.Tensor, positions: torch.Tensor, cache: Any) -> tuple[Any, torch.Tensor]:
            cache, logits = self.forward_tokens(ids, positions, cache)
            assert logits is not None
            return cache, logits

        def detokenize(tokens: list[int]) -> str:
            text: str = self.tokenizer.decode(tokens, skip_special_tokens=True)
            return text

        return decode_loop(
            forward, self.positions.text, detokenize, self._eos, cache, query_ids, start, config
        )

    # -- checks against the model's own forward ------------------------------------------------
    def reference_prefill(
        self, chunks: Sequence[Chunk], query_ids: torch.Tensor | None = None, *, anchor: Chunk | None = None
    ) -> Reference:
        """The model's own top-level forward over ``anchor + chunks (+ query)``: it computes its
        own positions (``get_rope_index`` for M-RoPE) and runs its own vision path."""
        inputs = self.reference_inputs(chunks, query_ids, anchor=anchor)
        if self.sliding is not None:  # every slot kept, to read chunks out (the model masks by slot)
            inputs[cache_kwarg(self.model)] = self.empty_cache()
        with torch.no_grad():
            out = self.model(**inputs, use_cache=True, **last_logits_only(self.model))
        kv = self.read_placed(output_cache(out), [anchor or self.anchor, *chunks])
        return Reference(kv, out.logits[0, -1].float().cpu())

    def read_placed(self, cache: Any, chunks: Sequence[Chunk]) -> tuple[ChunkKV, ...]:
        """Each of ``chunks``' KV out of a cache that holds them in order from slot 0, placed as a
        re-prefill places them (the first at position 0)."""
        kv, slot, start = [], 0, 0
        for chunk in chunks:
            where = chunk.positions_at(start)
            kv.append(
                read_chunk(cache, self.layout, slot, slot + chunk.num_tokens, where, chunk_key=chunk.key)
            )
            slot, start = slot + chunk.num_tokens, start + chunk.advance
        return tuple(kv)

    def reference_inputs(
        self, chunks: Sequence[Chunk], query_ids: torch.Tensor | None = None, *, anchor: Chunk | None = None
    ) -> dict[str, Any]:
        """Keyword arguments for the model's *own* forward over a full re-prefill of
        ``anchor + chunks (+ query)``: the ground truth every exactness check compares against
        (``anchor``: a window's own, e.g. a conversation's system block; default the encoder's).

        The model computes its own positions from these (``get_rope_index`` for M-RoPE), so a
        match also checks that our placement of every chunk agrees with the model's.
        """
        everything = [anchor or self.anchor, *chunks]
        tail = [] if query_ids is None else [query_ids]
        device = self.parts.device
        inputs: dict[str, Any] = {
            "input_ids": torch.cat([c.input_ids for c in everything] + tail)[None].to(device)
        }
        vision = [c for c in chunks if c.has_vision]
        if vision:
            if any(c.pixel_values is None for c in vision):
                raise CapabilityError(
                    "a chunk's pixels were released at eviction, so the model's own forward cannot be "
                    "rebuilt; keep them with WindowConfig(evicted_pixels='retain') to check recalled images"
                )
            inputs["pixel_values"] = torch.cat([c.pixel_values for c in vision]).to(device)  # type: ignore[misc]
            if all(c.image_grid_thw is not None for c in vision):
                inputs["image_grid_thw"] = torch.cat([c.image_grid_thw for c in vision]).to(device)  # type: ignore[misc]
                mm = torch.cat(
                    [c.mm_token_type_ids for c in everything] + [torch.zeros_like(t) for t in tail]
                )
                inputs["mm_token_type_ids"] = mm[None].to(device)
        return inputs

    def prefill_sequence(self, chunks: Sequence[Chunk], shift: int = 0) -> list[ChunkKV]:
        """The model's own KV of every chunk of ``anchor + chunks``, prefilled in order with every
        position moved by ``shift`` (one forward per chunk over the growing cache, which equals one
        forward over the whole sequence up to rounding). Ground truth for relocation checks."""
        anchor = self.anchor
        cache, out = self.assemble([]), []
        start, slot = anchor.advance + shift, anchor.num_tokens
        cache, _ = self._forward(anchor, anchor.positions_at(shift), cache)
        for chunk in chunks:
            positions = chunk.positions_at(start)
            cache, _ = self._forward(chunk, positions, cache)
            out.append(
                read_chunk(cache, self.layout, slot, slot + chunk.num_tokens, positions, chunk_key=chunk.key)
            )
            start, slot = start + chunk.advance, slot + chunk.num_tokens
        return out

    # -- forwards -----------------------------------------------------------------------------
    def forward_tokens(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: Any, *, logits: bool = True
    ) -> tuple[Any, torch.Tensor | None]:
        """Prefill text tokens ``[n]`` at ``positions`` over ``cache``; returns (cache, last logits)."""
        mm = torch.zeros_like(input_ids)
        return self.forward(input_ids, mm, positions, cache, None, logits=logits)

    def _forward(self, chunk: Chunk, positions: torch.Tensor, cache: Any) -> tuple[Any, torch.Tensor | None]:
        vision = self.encode_vision(chunk).features if chunk.has_vision else None
        return self.forward(chunk.input_ids, chunk.mm_token_type_ids, positions, cache, vision, logits=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        mm_types: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        vision: VisionFeatures | None = None,
        *,
        logits: bool = True,
        hidden: torch.Tensor | None = None,
        keys_at: torch.Tensor | None = None,
    ) -> tuple[Any, torch.Tensor | None]:
        """The model's own forward over ``cache`` for tokens ``[n]`` at ``positions``: embed, the
        vision tower's outputs over the image tokens (``mm_types == 1``; Qwen3-VL's deepstack
        features passed on), the decoder, the LM head on the last token (``logits``).

        ``hidden`` ``[n, cached + n]`` (bool): slots the tokens must not attend to besides the
        causal ones; passed to the model as a 4-D additive mask, which transformers uses as is.
        ``keys_at`` ``[cached + n]``: the position of every slot the tokens attend over, for a
        cache that does not append them in order (selective recompute writes rows in place);
        by default the cache's recorded positions, then the tokens'."""
        parts, device = self.parts, self.parts.device
        embeds = parts.embed(input_ids)  # [n, hidden]
        extra: dict[str, Any] = {}
        if vision is not None:
            image = mm_types == 1  # [n] on the host, as the chunk's ids: its rows found there
            rows = to_device(torch.nonzero(image).flatten(), device)
            # index_copy, not embeds[mask] = ...: a mask on the device is read back to count its rows
            embeds = embeds.index_copy(0, rows, vision["embeds"].to(device, embeds.dtype))
            deepstack = [
                vision[f"deepstack.{i}"] for i in range(len(vision) - 1) if f"deepstack.{i}" in vision
            ]
            if deepstack and parts.takes_deepstack:
                extra["visual_pos_masks"] = to_device(image, device)[None]
                extra["deepstack_visual_embeds"] = [d.to(device, embeds.dtype) for d in deepstack]
        past = cache.get_seq_length() if cache is not None else 0
        pos = positions[None] if positions.ndim == 1 else positions[:, None]  # [1, n] or [3, 1, n]
        mask = self._attention_mask(cache, positions, past, hidden, embeds.dtype, keys_at)
        with torch.no_grad():
            out = parts.language_model(
                inputs_embeds=embeds[None],
                position_ids=to_device(pos, device),
                attention_mask=mask,
                use_cache=True,
                **{parts.cache_kwarg: cache},
                **extra,
            )
            last = parts.logits(out.last_hidden_state[:, -1])[0] if logits else None
        return output_cache(out), last

    def _attention_mask(
        self,
        cache: Any,
        positions: torch.Tensor,
        past: int,
        hidden: torch.Tensor | None,
        dtype: torch.dtype,
        keys_at: torch.Tensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The ``attention_mask`` of a forward of ``n`` tokens at ``positions`` over ``past``
        slots: all-ones (transformers then masks causally) unless slots are ``hidden`` or
        layers slide; a sliding model's cache records the run's positions here (unless the
        slots' positions are given: ``keys_at``)."""
        device, n = self.parts.device, int(positions.shape[-1])
        if hidden is None and self.sliding is None:
            return torch.ones(1, past + n, dtype=torch.long, device=device)
        blocked = torch.ones(n, past + n, dtype=torch.bool).triu(past + 1)  # the future
        blocked = to_device(blocked if hidden is None else blocked | hidden, device)
        if self.sliding is None:
            mask = torch.zeros(1, 1, n, past + n, dtype=dtype, device=device)
            return mask.masked_fill_(blocked[None, None], torch.finfo(dtype).min)
        if keys_at is None:
            keys_at = torch.cat([cache.positions, positions.to("cpu")])
            cache.record(positions)
        return self.sliding.masks(to_device(positions, device), to_device(keys_at, device), blocked, dtype)


MASKED_ATTENTION = frozenset({"eager", "sdpa"})
"""Attention implementations that apply a custom 4-D additive mask as given (gapped prefills)."""


def _check_sliding(model: Any, masked: bool, positional_vision: bool) -> None:
    """Sliding-window layers are masked by position, with a 4-D mask per layer type.

    Raises:
        UnsupportedModelError: an attention kernel that takes no custom mask, or a vision model.
    """
    if not masked:
        raise UnsupportedModelError(
            f"{type(model).__name__} has sliding-window layers, which kamera masks by position: load it "
            "with attn_implementation='sdpa' or 'eager'"
        )
    if positional_vision:
        raise UnsupportedModelError(
            f"{type(model).__name__} has sliding-window layers and images; kamera masks sliding layers "
            "of text models only"
        )


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end an answer: the generation config's and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids


def _image_token(model: Any, tokenizer: Any) -> str | None:
    token_id = getattr(model.config, "image_token_id", None)
    if token_id is None:
        return None
    token: str = tokenizer.convert_ids_to_tokens(int(token_id))
    return token


def _merge_features(features: list[VisionFeatures]) -> dict[str, torch.Tensor] | None:
    """Vision outputs of several chunks, in order, as one (image tokens are filled in order)."""
    if not features:
        return None
    return {name: torch.cat([f[name] for f in features]) for name in features[0]}
