"""Decoding a query over an assembled cache, for any backend: greedy or sampled, with stop strings.

Why our own loop rather than an engine's ``generate``: the window's positions are ours (M-RoPE
ids continue after the window, not after the cache's slot count), and the query extends a cache
that was assembled, not prefilled. A backend hands in one function, ``forward(ids, positions,
cache) -> (cache, last logits)``; the loop, token choice and stop handling are the same for all,
so a sampled answer with a seed is the same whichever engine produced the logits.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

from kamera_agent.backends.base import DecodeConfig, Decoded, Spent
from kamera_agent.backends.decode_config import Constraint
from kamera_agent.critical_path import answered
from kamera_agent.results import Answer, TokenLogprob

__all__ = ["Forward", "decode_loop", "decoded_tokens", "pick_token", "sampler"]

Forward = Callable[[torch.Tensor, torch.Tensor, Any], tuple[Any, torch.Tensor]]
"""``(ids [n], positions [n] | [3, n], cache) -> (cache, logits [vocab] of the last token)``."""


def decode_loop(
    forward: Forward,
    text_positions: Callable[[int, int], torch.Tensor],
    detokenize: Callable[[list[int]], str],
    eos: Collection[int],
    cache: Any,
    query_ids: torch.Tensor,
    start: int,
    config: DecodeConfig,
) -> Decoded:
    """Prefill ``query_ids`` at ``start`` over ``cache``, then generate token by token."""
    if query_ids.numel() == 0:
        raise ValueError("the query tokenizes to no tokens")
    n_query = int(query_ids.shape[0])
    cache, logits = forward(query_ids, text_positions(start, n_query), cache)
    answered()  # the answer boundary: choosing a token brings its id (and these logits) to the host
    first_logits = logits.detach().to("cpu")
    generator = sampler(config.seed, logits.device)
    tokens: list[int] = []
    steps: list[torch.Tensor] = []
    logprobs: list[TokenLogprob] = []
    scores = _Scores(config, logits)
    guide = config.constraint() if config.constraint is not None else None
    finish, text = "length", ""
    stream = _Stream(config.on_text, config.stop)
    for _ in range(config.max_new_tokens):
        if config.keep_going is not None and not config.keep_going():
            finish = "cancelled"  # e.g. the client went away: no step more
            break
        if config.return_logits:
            steps.append(logits.detach().to("cpu"))
        adjusted, token = _choose(scores.adjust(logits, tokens), guide, config, generator)
        if token in eos:
            finish = "eos"
            break
        tokens.append(token)
        if config.top_logprobs is not None:
            logprobs.append(scores.logprob(adjusted, token, config.top_logprobs))
        text, stopped = _until_stop(detokenize(tokens), config.stop)
        if stopped:
            finish = "stop"
            break
        stream.saw(text)
        if guide is not None and guide.finished:
            finish = "stop"  # the grammar is complete: the answer is
            break
        if len(tokens) == config.max_new_tokens:
            break
        position = start + n_query + len(tokens) - 1  # the token just chosen
        cache, logits = forward(torch.tensor([token], dtype=torch.long), text_positions(position, 1), cache)
    stream.done(text)
    answer = Answer(
        text=text,
        tokens=tokens,
        first_logits=first_logits,
        logits=torch.stack(steps) if steps else None,
        finish_reason=finish,
        logprobs=tuple(logprobs) if config.top_logprobs is not None else None,
    )
    return Decoded(answer, _spent(answer, n_query))


def _choose(
    adjusted: torch.Tensor, guide: Constraint | None, config: DecodeConfig, generator: torch.Generator
) -> tuple[torch.Tensor, int]:
    """The scores masked by the grammar (where one guides the answer) and the token picked from
    them, which the grammar then accepts."""
    if guide is not None:
        adjusted = guide.mask(adjusted)
    token = pick_token(adjusted, config, generator)
    if guide is not None:
        guide.accept(token)
    return adjusted, token


def _until_stop(text: str, stop: Collection[str]) -> tuple[str, bool]:
    """``text`` cut before the first stop string it holds, and whether it held one."""
    hit = next((s for s in stop if s in text), None)
    return (text, False) if hit is None else (text[: text.index(hit)], True)


def _spent(answer: Answer, n_query: int) -> Spent:
    """What decoding ``answer`` cost: the query's prefill and one forward per decoded token."""
    steps = decoded_tokens(answer)
    return Spent(forwards=1 + steps, tokens_prefilled=n_query + steps, decode_steps=steps)


class _Scores:
    """The scores a token is chosen from: the model's logits plus ``logit_bias``, less the
    presence and frequency penalties of what the answer already holds (OpenAI's definitions)."""

    def __init__(self, config: DecodeConfig, logits: torch.Tensor) -> None:
        self.config = config
        self.bias: torch.Tensor | None = None
        if config.logit_bias:
            vocab = int(logits.shape[-1])
            ids = torch.tensor([t for t in config.logit_bias if t < vocab], dtype=torch.long)
            values = torch.tensor([config.logit_bias[int(t)] for t in ids], dtype=torch.float32)
            self.bias = torch.zeros(vocab, dtype=torch.float32).index_put_((ids,), values).to(logits.device)

    def adjust(self, logits: torch.Tensor, answer: list[int]) -> torch.Tensor:
        config = self.config
        if self.bias is None and not (answer and (config.presence_penalty or config.frequency_penalty)):
            return logits
        out = logits.float().clone()
        if self.bias is not None:
            out += self.bias
        if answer and (config.presence_penalty or config.frequency_penalty):
            ids, counts = torch.tensor(answer, dtype=torch.long).unique(return_counts=True)
            ids, counts = ids.to(out.device), counts.to(out.device, torch.float32)
            out[ids] -= config.presence_penalty + config.frequency_penalty * counts
        return out

    @staticmethod
    def logprob(scores: torch.Tensor, token: int, top: int) -> TokenLogprob:
        logp = torch.log_softmax(scores.float(), -1)
        best = torch.topk(logp, min(top, logp.numel())) if top else None
        alternatives = (
            tuple((int(i), float(v)) for v, i in zip(best.values, best.indices, strict=True)) if best else ()
        )
        return TokenLogprob(token, float(logp[token]), alternatives)


def decoded_tokens(answer: Answer) -> int:
    """Answer tokens the loop fed back through the model: all but the last one, which ended the
    answer, unless an EOS (never kept in ``tokens``) or a cancellation ended it. A prompt's own
    prefill is an answer's ``tokens_prefilled`` less these."""
    if answer.finish_reason in ("eos", "cancelled"):
        return len(answer.tokens)
    return max(0, len(answer.tokens) - 1)


class _Stream:
    """Hands the answer's text to ``on_text`` piece by piece, never a piece a stop string or a
    later token could take back (a partial stop string, an incomplete multi-byte character)."""

    def __init__(self, on_text: Callable[[str], None] | None, stop: Collection[str]) -> None:
        self.on_text, self.stop, self.sent = on_text, tuple(stop), 0

    def saw(self, text: str) -> None:
        if self.on_text is None:
            return
        safe = len(text.rstrip("\ufffd"))  # a character still being decoded renders as U+FFFD
        for stop in self.stop:
            for n in range(min(len(stop) - 1, safe), 0, -1):
                if text[:safe].endswith(stop[:n]):
                    safe -= n
                    break
        self._send(text, safe)

    def done(self, text: str) -> None:
        if self.on_text is not None:
            self._send(text, len(text))

    def _send(self, text: str, upto: int) -> None:
        assert self.on_text is not None
        if upto > self.sent:
            self.on_text(text[self.sent : upto])
            self.sent = upto


def sampler(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator one answer samples from: seeded, the same draws every time (on the same
    device); unseeded, fresh entropy (``Generator.seed``: the OS's random device), so two unseeded
    answers, or two choices of one request, differ as samples should. A generator made and never
    seeded would start every answer from the same fixed default seed."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


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
