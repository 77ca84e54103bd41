"""A tiny RoPE vision-language decoder on plain torch: the model behind the second backend.

Why a model of our own: a seam proven by one engine only proves that engine. This one shares
nothing with transformers: its rotary pairs are **interleaved** (``x[2i]``, ``x[2i + 1]``, applied
as a complex product like the original Llama code, unlike transformers' half split), and its
cache keeps per-layer ``[kv_heads, S, head_dim]`` tensors rather than ChunkKV's ``[L, H, n, D]``.
It takes explicit absolute positions for the tokens it appends, so a chunk can be prefilled
anywhere over any cache, and it caches keys after rotation. Matrices are drawn from
``normal(0, init_std)`` (0.08, not the usual 0.02) so that a chunk's KV depends measurably on
what precedes it at every layer past the first: a model that barely conditions hides bugs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["TinyConfig", "TinyKVCache", "TinyRopeLM"]


@dataclass(frozen=True)
class TinyConfig:
    """Sizes of `TinyRopeLM`; an image is ``(image_size / patch_size)**2`` tokens (16 by default)."""

    vocab_size: int = 264  # the byte tokenizer's 256 bytes + 8 specials: every id decodes
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 128
    rope_base: float = 10000.0
    max_positions: int = 8192
    patch_size: int = 4
    image_size: int = 16
    init_std: float = 0.08


class TinyKVCache:
    """Per-layer rotated keys and values, each ``[kv_heads, S, head_dim]``; appending grows ``S``."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values

    @classmethod
    def empty(cls, config: TinyConfig) -> TinyKVCache:
        def blank() -> torch.Tensor:
            return torch.zeros(config.kv_heads, 0, config.head_dim)

        return cls([blank() for _ in range(config.layers)], [blank() for _ in range(config.layers)])

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1])

    def append(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[kv_heads, n, head_dim]`` to a layer; return the layer's whole keys and values."""
        self.keys[layer] = torch.cat([self.keys[layer], keys], dim=1)
        self.values[layer] = torch.cat([self.values[layer], values], dim=1)
        return self.keys[layer], self.values[layer]


def _rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` ``[h, n, D]`` by unit complex ``rotation`` ``[n, D/2]``."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.c = c
        self.q = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, run: _Pass, layer: int) -> torch.Tensor:
        c, n = self.c, int(x.shape[0])
        q = _rope(self.q(x).view(n, c.heads, c.head_dim).transpose(0, 1), run.rotation)  # [H, n, D]
        k = _rope(self.k(x).view(n, c.kv_heads, c.head_dim).transpose(0, 1), run.rotation)  # [Hk, n, D]
        v = self.v(x).view(n, c.kv_heads, c.head_dim).transpose(0, 1)
        keys, values = run.cache.append(layer, k, v)  # [Hk, S, D]: the cache holds keys rotated
        group = c.heads // c.kv_heads  # query head h reads kv head h // group
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = q @ keys.transpose(1, 2) / math.sqrt(c.head_dim)  # [H, n, S]
        visible = torch.ones(n, keys.shape[1], dtype=torch.bool).tril(keys.shape[1] - n)  # causal by slot
        if run.hidden is not None:
            visible = visible & ~run.hidden
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out: torch.Tensor = self.o((weights @ values).transpose(0, 1).reshape(n, c.heads * c.head_dim))
        return out


@dataclass(frozen=True)
class _Pass:
    """What every layer of one forward shares: the rotation of the new tokens' positions
    (``[n, D/2]`` complex), the cache they append to, the slots hidden from them."""

    rotation: torch.Tensor
    cache: TinyKVCache
    hidden: torch.Tensor | None


class _Block(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(c.hidden, eps=1e-6), nn.RMSNorm(c.hidden, eps=1e-6)
        self.attn = _Attention(c)
        self.gate = nn.Linear(c.hidden, c.mlp, bias=False)
        self.up = nn.Linear(c.hidden, c.mlp, bias=False)
        self.down = nn.Linear(c.mlp, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, run: _Pass, layer: int) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), run, layer)
        h = self.mlp_norm(x)
        out: torch.Tensor = x + self.down(F.silu(self.gate(h)) * self.up(h))  # SwiGLU
        return out


class TinyRopeLM(nn.Module):
    """Embedding, pre-norm GQA decoder blocks, final norm, untied LM head and a patch vision tower.

    Args:
        config: sizes (default `TinyConfig()`).
        seed: seeds the weights, so two models built alike are identical.
    """

    def __init__(self, config: TinyConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        c = self.config = config or TinyConfig()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden)
        self.layers = nn.ModuleList(_Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.hidden, eps=1e-6)
        self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        patch = 3 * c.patch_size**2
        self.vision = nn.Sequential(nn.Linear(patch, c.hidden), nn.GELU(), nn.Linear(c.hidden, c.hidden))
        exponents = torch.arange(0, c.head_dim, 2, dtype=torch.int64).to(torch.float32) / c.head_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / (c.rope_base**exponents), persistent=False)  # [D/2] float32
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                if param.ndim == 2:  # matrices; norm weights stay 1, vision biases 0
                    param.normal_(0.0, c.init_std, generator=generator)
            for module in self.vision:
                if isinstance(module, nn.Linear):
                    nn.init.zeros_(module.bias)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[n, hidden]`` of ``input_ids`` ``[n]``."""
        out: torch.Tensor = self.embed_tokens(input_ids)
        return out

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One token ``[hidden]`` per patch: ``[patches, 3 * patch_size**2]`` -> ``[patches, hidden]``."""
        out: torch.Tensor = self.vision(pixel_values.to(torch.float32))
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[..., vocab]`` of final hidden states ``[..., hidden]``."""
        out: torch.Tensor = self.lm_head(hidden)
        return out

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: TinyKVCache,
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, TinyKVCache]:
        """Run ``embeds`` ``[n, hidden]`` at absolute ``positions`` ``[n]`` over ``cache``.

        The new tokens attend to every cached slot and to themselves causally (by slot, whatever
        the positions), except the slots ``hidden`` ``[n, cached + n]`` (bool) marks; their
        rotated keys and values are appended to ``cache``.

        Returns:
            Final-norm hidden states ``[n, hidden]`` and the (grown) cache.
        """
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [n, D/2] float32
        rotation = torch.polar(torch.ones_like(angles), angles)  # cos + i sin, in float32
        x, run = embeds, _Pass(rotation, cache, hidden)
        for layer, block in enumerate(self.layers):
            x = block(x, run, layer)
        return self.norm(x), cache
