"""Which drift budget a window or an engine runs with, from its settings and the model's calibration.

Why one place: a window and an engine adapter read the same setting (``drift_budget``) and the
same calibration, and must reach the same verdict on the same model: a number or
``"calibrated"`` bounds approximations with the model's own constants; a model never calibrated
(or an engine that cannot audit) runs exactly, with an `UncalibratedWarning`; ``None`` leaves
them unbounded. The warning names the model, so Python's warning registry shows it once per
model and call site (no state of ours to reset).

Budgets are shared where their learning is: windows on one store share what was audited (filed
there) and how often each op name needed a fix, so the budget lives with the store
(`ChunkStore.companion`): a new window, or a new ``kamera serve`` session, does not try again
what the others found over ε, and windows on separate stores learn separately.
"""

from __future__ import annotations

import warnings
from typing import Literal

from kamera_agent.config import WindowConfig
from kamera_agent.errors import UncalibratedWarning
from kamera_agent.fidelity.answer import ANSWER_SHARE
from kamera_agent.fidelity.calibration import Calibration, find_calibration
from kamera_agent.fidelity.drift_budget import DriftBudget, Units
from kamera_agent.store import ChunkStore

__all__ = ["ServeMode", "engine_budget", "serve_mode_of", "shared_budget", "window_budget"]

ServeMode = Literal["exact", "keep"]
"""What an engine may serve: only what a forward computes there, or kept states too (a mode,
not a policy: no strategy registered by name)."""


def _calibration(fingerprint: str, why_not: str | None, where: str) -> Calibration | None:
    """The model's calibration, or ``None`` with a warning naming the model and what runs instead."""
    calibration = find_calibration(fingerprint) if why_not is None else None
    if calibration is None:
        why = why_not or "this model has no drift calibration"
        warnings.warn(
            f"model {fingerprint[:12]}: {why}, so {where} runs exactly (no approximation is bounded "
            "without it): calibrate the model once with `kamera calibrate MODEL` (or set drift_budget "
            "None to approximate unbounded, or use WindowConfig.exact())",
            UncalibratedWarning,
            stacklevel=4,
        )
    return calibration


def _epsilon(config: WindowConfig, calibration: Calibration) -> float:
    return calibration.budget if config.drift_budget == "calibrated" else float(config.drift_budget or 0)


def window_budget(
    config: WindowConfig, fingerprint: str, store: ChunkStore, can_audit: bool = True
) -> tuple[WindowConfig, DriftBudget | None]:
    """The settings a window runs with and its budget (shared with the windows on ``store``).

    ``answer_budget`` set: a budget in answer units, which needs no calibration (an engine that
    cannot recompute tokens runs exactly, with an `UncalibratedWarning`). Else
    ``drift_budget=None``: the settings as given, no budget. A budget of 0, or any budget on a
    model with no calibration or an engine that cannot audit (`Backend.supports_recompute`): the
    settings with every approximation off (`WindowConfig.exactly`), the latter two with an
    `UncalibratedWarning`.
    """
    why_not = None if can_audit else "this engine cannot recompute sampled tokens to audit drift"
    if config.answer_budget is not None:
        if why_not is not None:
            _calibration(fingerprint, why_not, "the window")  # warns
            return config.exactly(), None
        # no constants to fit: the planner charges each judged chunk its recomputed rows as audits
        answer = Calibration(fingerprint, scale=1.0, inherit=0.0, audit_share=ANSWER_SHARE)
        return config, shared_budget(store, fingerprint, config.answer_budget, answer, "answer")
    if config.drift_budget is None:
        return config, None
    if config.drift_budget == 0:
        return config.exactly(), None
    calibration = _calibration(fingerprint, why_not, "the window")
    if calibration is None:
        return config.exactly(), None
    epsilon = _epsilon(config, calibration)
    if epsilon == 0:
        return config.exactly(), None
    return config, shared_budget(store, fingerprint, epsilon, calibration)


def serve_mode_of(config: WindowConfig) -> ServeMode:
    """What an engine may serve under ``config``: kept states only where survivors keep them."""
    return "keep" if config.survivors == "keep" else "exact"


def engine_budget(config: WindowConfig, fingerprint: str) -> tuple[ServeMode, DriftBudget | None]:
    """The mode an engine serves in under ``config`` and the drift budget its kept states stay within.

    ``drift_budget=None``: kept states unbounded (their drift unknown); 0: exact; a number or
    ``"calibrated"``: the model's calibration bounds them, and a model without one serves
    exactly, with an `UncalibratedWarning`."""
    mode = serve_mode_of(config)
    if mode == "exact" or config.drift_budget is None:
        return mode, None
    if config.drift_budget == 0:
        return "exact", None
    calibration = _calibration(fingerprint, None, "the engine")
    if calibration is None:
        return "exact", None
    epsilon = _epsilon(config, calibration)
    if epsilon == 0:
        return "exact", None
    return mode, DriftBudget(epsilon, calibration)


def shared_budget(
    store: ChunkStore, fingerprint: str, epsilon: float, calibration: Calibration, units: Units = "kv"
) -> DriftBudget:
    """The one budget of this model, ε, units and calibration among the windows on ``store``."""
    key = f"drift-budget:{fingerprint}:{units}:{epsilon!r}:{calibration.to_json()}"
    return store.companion(key, lambda: DriftBudget(epsilon, calibration, units))
