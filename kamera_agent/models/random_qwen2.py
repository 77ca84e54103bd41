"""Random-initialised Qwen2 language models of a chosen shape, built locally (no download).

Why one builder: the operator benchmark, ``kamera bench --suite cost`` and the operator demo all
time or demonstrate reuse on a realistic *shape* (e.g. 8 layers of a 1.5B-class GQA model) whose
weights do not matter; they must build it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["QWEN2_1_5B_SLICE", "Qwen2Shape", "random_qwen2"]


@dataclass(frozen=True)
class Qwen2Shape:
    """A Qwen2 decoder shape: layers, widths, heads, vocabulary."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int


QWEN2_1_5B_SLICE = Qwen2Shape(layers=8, hidden=1536, heads=12, kv_heads=2, mlp=8960, vocab=32000)
"""8 decoder layers of a 1.5B-class Qwen2 (GQA 12/2, head_dim 128): the benchmarks' default."""


def random_qwen2(
    shape: Qwen2Shape,
    *,
    seed: int = 0,
    attention: str = "sdpa",
    init_std: float | None = None,
    max_positions: int = 131072,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A ``Qwen2ForCausalLM`` of ``shape`` with random weights, in eval mode.

    ``init_std`` above the default 0.02 gives a model whose chunks visibly condition on each
    other (useful for demos of the patch); timing does not depend on it.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max_positions,
    )
    if init_std is not None:
        config.initializer_range = init_std
    config._attn_implementation = attention
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).eval()  # type: ignore[arg-type]  # transformers types .to oddly
