"""Ground truth for window tests: every chunk's KV against a full re-prefill of the window."""

from __future__ import annotations

from typing import Any

import torch

from kamera_agent.compat import output_cache
from kamera_agent.window import KameraWindow
from tests.kv_helpers import next_token_kl, rel_err


def reprefill(window: KameraWindow, query: str | None = None) -> tuple[Any, torch.Tensor]:
    """The model's own forward over the window's full sequence: (cache, last logits)."""
    inputs = window.as_model_inputs(query)
    with torch.no_grad():
        out = window.backend.model(**inputs, use_cache=True)  # type: ignore[attr-defined]
    return output_cache(out), out.logits[0, -1]


def chunk_errors(window: KameraWindow) -> dict[str, float]:
    """Relative error of each in-window chunk's assembled KV against the re-prefill's, by label."""
    truth, _ = reprefill(window)
    ours = window.kv()
    errors, slot = {}, window.backend.anchor.num_tokens
    for ref in window.refs:
        n = window.chunk(ref).num_tokens
        worst = 0.0
        for layer in range(len(truth.layers)):
            for name in ("keys", "values"):
                want = getattr(truth.layers[layer], name)[0, :, slot : slot + n]
                got = getattr(ours.layers[layer], name)[0, :, slot : slot + n]
                worst = max(worst, rel_err(got, want))
        errors[ref.label] = worst
        slot += n
    return errors


def answer_kl(window: KameraWindow, query: str = "What is it?") -> float:
    """Next-token KL(re-prefill ‖ window) for ``query``."""
    _, reference = reprefill(window, query)
    return next_token_kl(reference, window.ask(query, max_new_tokens=1).first_logits)
