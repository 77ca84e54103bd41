"""Decoding a query over an assembled cache: greedy or sampled, with stop strings.

Why our own loop rather than ``generate``: the window's positions are ours (M-RoPE ids
continue after the window, not after the cache slot count), and the query must extend a
cache that was assembled, not prefilled; a short explicit loop keeps both exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kamera_agent.backends.base import Answer, DecodeConfig

if TYPE_CHECKING:
    from kamera_agent.backends.transformers_backend import TransformersBackend

__all__ = ["decode_loop", "eos_token_ids", "pick_token"]


def decode_loop(
    backend: TransformersBackend, cache: Any, query_ids: torch.Tensor, start: int, config: DecodeConfig
) -> Answer:
    """Prefill ``query_ids`` at ``start`` over ``cache``, then generate token by token."""
    if query_ids.numel() == 0:
        raise ValueError("the query tokenizes to no tokens")
    positions = backend.positions.text(start, int(query_ids.shape[0]))
    cache, logits = backend.forward_tokens(query_ids, positions, cache)
    assert logits is not None
    first_logits = logits.detach().to("cpu")
    generator = torch.Generator(device=logits.device)
    if config.seed is not None:
        generator.manual_seed(config.seed)
    eos = eos_token_ids(backend.model, backend.tokenizer)
    tokens: list[int] = []
    steps: list[torch.Tensor] = []
    position = start + int(query_ids.shape[0])
    finish = "length"
    text = ""
    for _ in range(config.max_new_tokens):
        if config.return_logits:
            steps.append(logits.detach().to("cpu"))
        token = pick_token(logits, config, generator)
        if token in eos:
            finish = "eos"
            break
        tokens.append(token)
        backend.counters.decode_steps += 1
        text = backend.tokenizer.decode(tokens, skip_special_tokens=True)
        hit = next((s for s in config.stop if s in text), None)
        if hit is not None:
            text = text[: text.index(hit)]
            finish = "stop"
            break
        if len(tokens) == config.max_new_tokens:
            break
        step_ids = torch.tensor([token], dtype=torch.long)
        cache, next_logits = backend.forward_tokens(step_ids, backend.positions.text(position, 1), cache)
        assert next_logits is not None
        logits = next_logits
        position += 1
    return Answer(
        text=text,
        tokens=tokens,
        first_logits=first_logits,
        logits=torch.stack(steps) if steps else None,
        finish_reason=finish,
    )


def pick_token(logits: torch.Tensor, config: DecodeConfig, generator: torch.Generator) -> int:
    """Greedy when ``temperature == 0``; else temperature, top-k and top-p sampling."""
    if config.temperature <= 0:
        return int(torch.argmax(logits))
    scores = logits.float() / config.temperature
    if config.top_k > 0:
        kth = torch.topk(scores, min(config.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        mass = torch.softmax(ordered, -1).cumsum(-1)
        drop = mass - torch.softmax(ordered, -1) > config.top_p  # keep the token that crosses top_p
        scores[order[drop]] = float("-inf")
    probs = torch.softmax(scores, -1)
    return int(torch.multinomial(probs, 1, generator=generator))


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
