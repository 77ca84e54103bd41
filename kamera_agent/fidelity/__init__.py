"""Fidelity: whether an approximated chunk's KV may stand, decided in one place.

Why one package: a window's planner forecasts with the drift budget, its runner enforces it,
an engine adapter serves kept states within it and ``kamera calibrate`` fits it; each reads the
same object (`DriftBudget`: ε, the model's `Calibration`, the audits measured and the fix shares
ops spent), so a window and an engine on the same model reach the same verdict. Code outside
this package imports from here only (an import contract holds it), so the estimator
and the budget's internals change in one place.

- `calibration`: a model's fitted constants and default ε, filed by fingerprint.
- `audits`: the sampled audit (a chunk's KV against a few of its rows recomputed) and errors.
- `drift_budget`: the estimate chained left to right, the verdict per chunk, the fix shares.
- `answer`: drift judged in answer units (a probe's answer before and after a repair).
- `resolve`: which budget a window or an engine runs with, from its settings.
- `vouching`: what a kept state no audit measured is bounded by (its class and distance).
"""

from kamera_agent.fidelity.answer import (
    ANSWER_SHARE,
    AnswerEstimate,
    combined,
    estimate_answer,
    room,
    spread,
)
from kamera_agent.fidelity.audits import (
    AuditSource,
    Filed,
    Measure,
    audit,
    audit_count,
    audit_indices,
    filed_in,
    relative_error,
    sampled_error,
)
from kamera_agent.fidelity.calibration import (
    AGREEMENT,
    BUDGETS,
    CALIBRATION_DIR_VARIABLE,
    MEAN_KL,
    Calibration,
    calibration_dirs,
    find_calibration,
    save_calibration,
)
from kamera_agent.fidelity.drift_budget import DriftBudget, Units
from kamera_agent.fidelity.resolve import (
    ServeMode,
    engine_budget,
    serve_mode_of,
    shared_budget,
    window_budget,
)
from kamera_agent.fidelity.vouching import CLASSES, DISTANCES, absorbed_gone, vouch_class

__all__ = [
    "AGREEMENT",
    "ANSWER_SHARE",
    "BUDGETS",
    "CALIBRATION_DIR_VARIABLE",
    "CLASSES",
    "DISTANCES",
    "MEAN_KL",
    "AnswerEstimate",
    "AuditSource",
    "Calibration",
    "DriftBudget",
    "Filed",
    "Measure",
    "ServeMode",
    "Units",
    "absorbed_gone",
    "audit",
    "audit_count",
    "audit_indices",
    "calibration_dirs",
    "combined",
    "engine_budget",
    "estimate_answer",
    "filed_in",
    "find_calibration",
    "relative_error",
    "room",
    "sampled_error",
    "save_calibration",
    "serve_mode_of",
    "shared_budget",
    "spread",
    "vouch_class",
    "window_budget",
]
