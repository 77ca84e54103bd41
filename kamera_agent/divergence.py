"""The two measures every fidelity check in kamera-agent uses, defined once.

Why here: the window's probe, the demo evaluator, ``kamera check`` and the tests all compare a
reused KV or answer with the model's own; they must compute the comparison the same way.
"""

from __future__ import annotations

import torch

__all__ = ["next_token_kl", "relative_error"]


def next_token_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p ‖ q) of the next-token distributions of two logit vectors ``[V]``, in float64."""
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.to(p.device).double(), -1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got − want‖ / ‖want‖`` (Frobenius), in float64."""
    want64 = want.double()
    return float((got.to(want.device).double() - want64).norm() / want64.norm().clamp_min(1e-30))
