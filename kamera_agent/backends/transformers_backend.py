"""The transformers backend: chunks through a Hugging Face model, on CPU or GPU.

``encode`` prefills a chunk behind the shared anchor prefix (vision tower output cached by
content key) and stores the result position-free; ``condition`` prefills it over an
assembled antecedent; ``assemble`` concatenates placed chunks into a ``DynamicCache``;
``decode`` answers a query placed after the window with explicit positions (M-RoPE ids
included), greedy or sampled. Every forward lands in `counters`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from kamera_agent.backends.base import Answer, Backend, BackendCounters, DecodeConfig
from kamera_agent.backends.decoding import decode_loop
from kamera_agent.backends.hf_parts import ModelParts, model_parts
from kamera_agent.chunks.chunk import Chunk
from kamera_agent.chunks.encoder import ChunkEncoder
from kamera_agent.chunks.positions import position_scheme
from kamera_agent.chunks.prompt import PromptFormat
from kamera_agent.compat import output_cache
from kamera_agent.errors import ForeignChunkError, UnsupportedModelError
from kamera_agent.fingerprint import model_fingerprint
from kamera_agent.operator.layout import ChunkKV, kv_layout, read_chunk, to_position_free
from kamera_agent.store import ChunkStore

__all__ = ["DEFAULT_MEMORY_BUDGET", "TransformersBackend"]

DEFAULT_MEMORY_BUDGET = 2 << 30
"""Bytes of canonicals, vision outputs and patches a backend's default store keeps in memory."""


class TransformersBackend(Backend):
    """Backend over a loaded transformers model.

    Args:
        model: a causal LM or image-text-to-text model (Qwen2/2.5/3-VL, Llama, Qwen2, DeepSeek-V2/V3 ...).
        processor: a full processor (with ``tokenizer`` and ``image_processor``), if you have one.
        tokenizer: the tokenizer, when no processor is given.
        image_processor: the image processor, when no processor is given (VLMs).
        prompt: where chunks sit in the chat template (default: read from the tokenizer's template).
        store: the `ChunkStore` for canonicals, vision-tower outputs and patches (default: an
            in-memory store of `DEFAULT_MEMORY_BUDGET` bytes, for this model's fingerprint).
    """

    supports_mla = True

    def __init__(
        self,
        model: Any,
        processor: Any | None = None,
        *,
        tokenizer: Any | None = None,
        image_processor: Any | None = None,
        prompt: PromptFormat | None = None,
        store: ChunkStore | None = None,
    ) -> None:
        tokenizer = tokenizer or getattr(processor, "tokenizer", None)
        image_processor = image_processor or getattr(processor, "image_processor", None)
        if tokenizer is None:
            raise UnsupportedModelError("pass tokenizer= (or a processor that has one) with the model")
        self.model = model.eval()
        self.parts: ModelParts = model_parts(model)
        self.layout = kv_layout(model)
        self.fingerprint = model_fingerprint(model)
        self.tokenizer = tokenizer
        if store is not None and store.fingerprint != self.fingerprint:
            raise ForeignChunkError(
                "this store holds KV of another model (fingerprints differ); open one store per model "
                "(a separate disk_dir) or pass no store"
            )
        self.store = store or ChunkStore(fingerprint=self.fingerprint, memory_budget=DEFAULT_MEMORY_BUDGET)
        self.counters = BackendCounters()
        image_token = _image_token(model, tokenizer) if self.parts.has_vision else None
        self.prompt = prompt or PromptFormat.from_tokenizer(tokenizer, image_token)
        merge = int(getattr(getattr(model.config, "vision_config", None), "spatial_merge_size", 1) or 1)
        self.positions = position_scheme(model, self.layout.rope.is_mrope)
        self.encoder = ChunkEncoder(
            tokenizer,
            image_processor if self.parts.has_vision else None,
            self.prompt,
            self.positions,
            self.fingerprint,
            merge,
            self.parts.tokens_per_image(),
        )
        self._anchor: Chunk | None = None
        self._anchor_kv: ChunkKV | None = None

    @property
    def supports_vision(self) -> bool:  # type: ignore[override]
        return self.parts.has_vision

    # -- the anchor prefix ------------------------------------------------------------------
    @property
    def anchor(self) -> Chunk:
        """The anchor chunk every window starts with, at position 0."""
        if self._anchor is None:
            self._anchor = self.encoder.anchor()
        return self._anchor

    def anchor_kv(self) -> ChunkKV:
        """The anchor's KV at positions ``[0, anchor.advance)``; computed once."""
        if self._anchor_kv is None:
            chunk = self.anchor
            positions = chunk.positions_at(0)
            cache, _ = self._forward(chunk, positions, self.assemble([]))
            self._anchor_kv = read_chunk(
                cache,
                self.layout,
                0,
                chunk.num_tokens,
                positions,
                chunk_key=chunk.key,
                model_fingerprint=self.fingerprint,
            )
        return self._anchor_kv

    # -- Backend --------------------------------------------------------------------------
    def encode(self, chunk: Chunk) -> ChunkKV:
        self._check_chunk(chunk)
        hit = self.store.get_canonical(chunk.key)
        if hit is not None:
            self.counters.canonical_hits += 1
            return _on_device(hit, self.parts.device)  # the disk tier reads back onto the CPU
        start = self.anchor.advance
        positions = chunk.positions_at(start)
        cache, _ = self._forward(chunk, positions, self.assemble([self.anchor_kv()]))
        n_anchor = self.anchor.num_tokens
        placed = read_chunk(
            cache,
            self.layout,
            n_anchor,
            n_anchor + chunk.num_tokens,
            positions,
            chunk_key=chunk.key,
            model_fingerprint=self.fingerprint,
        )
        canonical = to_position_free(placed, self.layout)
        self.store.put_canonical(canonical)
        return canonical

    def condition(self, chunk: Chunk, before: Sequence[ChunkKV], start: int) -> ChunkKV:
        return self.condition_run([chunk], before, start)[0]

    def condition_run(self, chunks: Sequence[Chunk], before: Sequence[ChunkKV], start: int) -> list[ChunkKV]:
        """``KV(B_i | before, B_<i)`` for consecutive chunks starting at ``start``, in one forward.

        One forward over the run gives every chunk its conditioning on the exact KV of the
        chunks before it in the run (what a re-prefill of the run computes), in the time of a
        single prefill of the run's tokens.
        """
        for chunk in chunks:
            self._check_chunk(chunk)
        positions, position = [], start
        for chunk in chunks:
            positions.append(chunk.positions_at(position))
            position += chunk.advance
        ids = torch.cat([c.input_ids for c in chunks])
        mm = torch.cat([c.mm_token_type_ids for c in chunks])
        vision = _merge_features([self.vision_features(c) for c in chunks if c.has_vision])
        offset = sum(kv.num_tokens for kv in before)
        cache, _ = self._run(
            ids, mm, torch.cat(positions, dim=-1), self.assemble(before), vision, logits=False
        )
        out, slot = [], offset
        for chunk, where in zip(chunks, positions, strict=True):
            kv = read_chunk(cache, self.layout, slot, slot + chunk.num_tokens, where, chunk_key=chunk.key)
            out.append(replace(kv, model_fingerprint=self.fingerprint))
            slot += chunk.num_tokens
        return out

    def assemble(self, placed: Sequence[ChunkKV]) -> Any:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if not placed:
            return cache
        for kv in placed:
            if kv.positions is None:
                raise ValueError(
                    "assemble needs placed KV (positions set); place canonicals with apply_patch"
                )
        keys = torch.cat([kv.keys for kv in placed], dim=2)  # [L, H, S, D]
        values = torch.cat([kv.values for kv in placed], dim=2)
        for layer in range(self.layout.num_layers):
            cache.update(keys[layer][None], values[layer][None], layer)
        return cache

    def decode(self, cache: Any, query_ids: torch.Tensor, start: int, config: DecodeConfig) -> Answer:
        return decode_loop(self, cache, query_ids, start, config)

    def prefill_sequence(self, chunks: Sequence[Chunk], shift: int = 0) -> list[ChunkKV]:
        """The model's own KV of every chunk of ``anchor + chunks``, prefilled in order with every
        position moved by ``shift`` (one forward per chunk over the growing cache, which equals one
        forward over the whole sequence up to rounding). Ground truth for relocation checks."""
        cache, out = self.assemble([]), []
        start, slot = self.anchor.advance + shift, self.anchor.num_tokens
        cache, _ = self._forward(self.anchor, self.anchor.positions_at(shift), cache)
        for chunk in chunks:
            positions = chunk.positions_at(start)
            cache, _ = self._forward(chunk, positions, cache)
            out.append(
                read_chunk(cache, self.layout, slot, slot + chunk.num_tokens, positions, chunk_key=chunk.key)
            )
            start, slot = start + chunk.advance, slot + chunk.num_tokens
        return out

    def reference_inputs(
        self, chunks: Sequence[Chunk], query_ids: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """Keyword arguments for the model's *own* forward over a full re-prefill of
        ``anchor + chunks (+ query)``: the ground truth every exactness check compares against.

        The model computes its own positions from these (``get_rope_index`` for M-RoPE), so a
        match also checks that our placement of every chunk agrees with the model's.
        """
        everything = [self.anchor, *chunks]
        tail = [] if query_ids is None else [query_ids]
        device = self.parts.device
        inputs: dict[str, Any] = {
            "input_ids": torch.cat([c.input_ids for c in everything] + tail)[None].to(device)
        }
        vision = [c for c in chunks if c.has_vision]
        if vision:
            inputs["pixel_values"] = torch.cat([c.pixel_values for c in vision]).to(device)  # type: ignore[misc]
            if all(c.image_grid_thw is not None for c in vision):
                inputs["image_grid_thw"] = torch.cat([c.image_grid_thw for c in vision]).to(device)  # type: ignore[misc]
                mm = torch.cat(
                    [c.mm_token_type_ids for c in everything] + [torch.zeros_like(t) for t in tail]
                )
                inputs["mm_token_type_ids"] = mm[None].to(device)
        return inputs

    # -- vision -----------------------------------------------------------------------------
    def vision_features(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """The vision tower's output for a chunk's pixels, cached by the pixels' content key."""
        assert chunk.pixel_values is not None and chunk.vision_key
        cached = self.store.get_vision(chunk.vision_key)
        if cached is not None:
            self.counters.vision_cache_hits += 1
            return {name: t.to(self.parts.device) for name, t in cached.items()}
        features = self.parts.image_features(chunk.pixel_values, chunk.image_grid_thw)
        self.counters.vision_forwards += 1
        self.store.put_vision(chunk.vision_key, features)
        return features

    # -- forwards -----------------------------------------------------------------------------
    def forward_tokens(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: Any, *, logits: bool = True
    ) -> tuple[Any, torch.Tensor | None]:
        """Prefill text tokens ``[n]`` at ``positions`` over ``cache``; returns (cache, last logits)."""
        mm = torch.zeros_like(input_ids)
        return self._run(input_ids, mm, positions, cache, None, logits)

    def _forward(self, chunk: Chunk, positions: torch.Tensor, cache: Any) -> tuple[Any, torch.Tensor | None]:
        vision = self.vision_features(chunk) if chunk.has_vision else None
        return self._run(chunk.input_ids, chunk.mm_token_type_ids, positions, cache, vision, logits=False)

    def _run(
        self,
        input_ids: torch.Tensor,
        mm_types: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        vision: dict[str, torch.Tensor] | None,
        logits: bool,
    ) -> tuple[Any, torch.Tensor | None]:
        parts, device = self.parts, self.parts.device
        embeds = parts.embed(input_ids)  # [n, hidden]
        extra: dict[str, Any] = {}
        if vision is not None:
            image_mask = (mm_types == 1).to(device)
            embeds = embeds.clone()
            embeds[image_mask] = vision["embeds"].to(device, embeds.dtype)
            deepstack = [
                vision[f"deepstack.{i}"] for i in range(len(vision) - 1) if f"deepstack.{i}" in vision
            ]
            if deepstack and parts.takes_deepstack:
                extra["visual_pos_masks"] = image_mask[None]
                extra["deepstack_visual_embeds"] = [d.to(device, embeds.dtype) for d in deepstack]
        past = cache.get_seq_length() if cache is not None else 0
        n = int(input_ids.shape[0])
        pos = positions[None] if positions.ndim == 1 else positions[:, None]  # [1, n] or [3, 1, n]
        with torch.no_grad():
            out = parts.language_model(
                inputs_embeds=embeds[None],
                position_ids=pos.to(device),
                attention_mask=torch.ones(1, past + n, dtype=torch.long, device=device),
                use_cache=True,
                **{parts.cache_kwarg: cache},
                **extra,
            )
            last = parts.lm_head(out.last_hidden_state[:, -1]).float()[0] if logits else None
        self.counters.lm_forwards += 1
        self.counters.tokens_prefilled += n
        return output_cache(out), last

    def _check_chunk(self, chunk: Chunk) -> None:
        """Refuse a chunk prepared for another model or processing setting (a string compare:
        the chunk carries the digest its content key was made with)."""
        if chunk.origin != self.encoder.origin:
            raise ForeignChunkError(
                f"chunk {chunk.key[:12]}… was prepared for another model or processor setting; "
                "re-create it with this window's encoder (window.push does this for you)"
            )


def _image_token(model: Any, tokenizer: Any) -> str | None:
    token_id = getattr(model.config, "image_token_id", None)
    if token_id is None:
        return None
    token: str = tokenizer.convert_ids_to_tokens(int(token_id))
    return token


def _on_device(kv: ChunkKV, device: torch.device) -> ChunkKV:
    if kv.keys.device == device:
        return kv
    return replace(kv, keys=kv.keys.to(device), values=kv.values.to(device))


def _merge_features(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """Vision outputs of several chunks, in order, as one (image tokens are filled in order)."""
    if not features:
        return None
    return {name: torch.cat([f[name] for f in features]) for name in features[0]}
