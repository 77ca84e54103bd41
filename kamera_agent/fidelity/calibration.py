"""A model's calibration: the constants its drift estimate is kept with, fitted on its own episodes.

Why filed by fingerprint: a calibration's scale and default ε are what one model's approximations
measured against its own re-prefills (``kamera calibrate``); another model's constants bound
nothing. The user's directory is searched first, then the calibrations shipped in the package.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "AGREEMENT",
    "BUDGETS",
    "CALIBRATION_DIR_VARIABLE",
    "MEAN_KL",
    "Calibration",
    "calibration_dirs",
    "find_calibration",
    "save_calibration",
]

CALIBRATION_DIR_VARIABLE = "KAMERA_CALIBRATION_DIR"
"""Where ``kamera calibrate`` files calibrations (default ``~/.cache/kamera/calibration``)."""

_SHIPPED = Path(__file__).resolve().parent.parent / "models" / "calibrations"
"""Calibrations of the models kamera ships, found like the user's own."""


@dataclass(frozen=True)
class Calibration:
    """A model's drift estimator, fitted on its own episodes.

    Attributes:
        fingerprint: the model it was fitted on (`Backend.fingerprint`); used for no other.
        scale: the audit's multiplier: on the fitting episodes, ``quantile`` of the approximated
            chunks have a true error at most ``scale × audit + inherit × inherited``.
        inherit: the share of the largest estimate to a chunk's left that it inherits (fitted
            with the scale: the share whose default ε lets the most ops stand).
        audit_share: the share of a chunk's tokens one audit recomputes (at least two tokens).
        quantile: the share of fitting chunks the scale bounds.
        budget: the ε a window uses by default, picked from ``frontier``: the largest of `BUDGETS`
            up to which, at every ε, the fitting episodes' ops the budget would let stand answered
            like a re-prefill (first answer token equal on at least `AGREEMENT` of them and on no
            fewer than ``floor``, mean next-token KL at most `MEAN_KL`); the smallest where none
            does.
        floor: the share of the fitting episodes' ops on which the model's own re-prefill in
            bf16 gave the fp32 one's first token (the noise a bf16 deployment already accepts;
            ``None``: not measured).
        samples: approximated chunk-states it was fitted on.
        seeds: the fitting episodes' seeds (benchmarks judge on other seeds).
        within: per ε of `BUDGETS`, the share of fitting chunks estimated within ε that were
            truly over 3ε (the budget's calibration target: at most 1 %).
        recompute_share: the share of an over-budget chunk's tokens the budget's cheapest fix
            recomputes (its most deviating ones, CacheBlend's 15 % by default) before it
            re-prefills the chunk and what follows.
        fix_shares: per op name that moves chunks, ``[ops that approximated, the shares of their
            fix bounds their fixes would re-prefill, summed]`` on the fitting episodes at the
            default ε (an op's fix bound is re-prefilling from its first approximated chunk to
            the end; its fixes re-prefill each chunk over ε alone): how much of what an op's
            approximations save its fixes give back, known to a new window from its first op (a
            `DriftBudget` starts from these, capped) instead of paid for in audits and fixes.
        frontier: per ε of `BUDGETS`, what the fitting episodes' approximating ops measured at
            it: ``standing`` (the share of them estimated within ε: served as they are),
            ``agreement`` (of those, the share whose first answer token was re-prefill's) and
            ``kl_mean`` (their mean next-token KL against re-prefill).
        vouch_bounds: per class of `kamera_agent.fidelity.vouching.CLASSES`, per distance from
            the first approximated chunk (the last for every farther one), the bound a kept
            state no audit measured is estimated at: ``quantile`` of the fitting chunks' true
            errors there, non-increasing with distance. Empty: only an audit vouches.
        vouch_budget: the ε those bounds may serve within (never above the window's): the
            largest of `BUDGETS` up to which, at every ε, the fitting episodes' ops whose every
            approximated chunk the bounds put within it answered like a re-prefill and were
            enough to show it (no audit backs an engine's kept state, so a point passed on
            a few ops does not count).
        vouch_frontier: per ε of `BUDGETS`, those ops as in ``frontier``.
    """

    fingerprint: str
    scale: float
    inherit: float = 0.5
    audit_share: float = 0.1
    quantile: float = 0.99
    budget: float = 1e-2
    samples: int = 0
    seeds: tuple[int, ...] = ()
    within: dict[str, float] = field(default_factory=dict)
    fix_shares: dict[str, tuple[int, float]] = field(default_factory=dict)
    recompute_share: float = 0.15
    frontier: dict[str, dict[str, float]] = field(default_factory=dict)
    vouch_bounds: dict[str, tuple[float, ...]] = field(default_factory=dict)
    vouch_budget: float = 0.0
    vouch_frontier: dict[str, dict[str, float]] = field(default_factory=dict)
    floor: float | None = None

    def vouch_bound(self, kind: str, distance: int) -> float | None:
        """The bound on a kept state's drift of class ``kind`` at ``distance`` from the first
        approximated chunk, or ``None`` where none was fitted."""
        bounds = self.vouch_bounds.get(kind)
        if not bounds:
            return None
        return bounds[min(max(0, distance), len(bounds) - 1)]

    def estimate(self, audit: float, inherited: float) -> float:
        """A chunk's estimated drift from its audit and the largest estimate to its left."""
        return self.scale * audit + self.inherit * inherited

    def to_json(self) -> str:
        data = {**asdict(self), "seeds": list(self.seeds)}
        data["fix_shares"] = {op: list(counts) for op, counts in self.fix_shares.items()}
        data["vouch_bounds"] = {kind: list(bounds) for kind, bounds in self.vouch_bounds.items()}
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        data: dict[str, Any] = json.loads(text)
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        known["seeds"] = tuple(known.get("seeds", ()))
        # a file from before fix shares counted each op that needed a fix as its whole bound
        shares = data.get("fix_shares", data.get("fix_rates", {}))
        known["fix_shares"] = {
            str(op): (int(ops), float(spent)) for op, (ops, spent) in shares.items() if 0 <= spent <= ops
        }
        known["vouch_bounds"] = {
            str(kind): tuple(float(b) for b in bounds)
            for kind, bounds in known.get("vouch_bounds", {}).items()
        }
        return cls(**known)

    @property
    def fix_rates(self) -> dict[str, tuple[int, float]]:
        """Deprecated name of `fix_shares`."""
        warnings.warn("Calibration.fix_rates is now fix_shares", DeprecationWarning, stacklevel=2)
        return self.fix_shares


BUDGETS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 2e-1, 3e-1, 5e-1)
"""The budgets a calibration chooses its default from (relative KV error estimates)."""

AGREEMENT = 0.99
"""The share of the ops a default budget lets stand whose first answer token must be re-prefill's
on the fitting episodes (the bench reports the model's own bf16 re-prefill beside it)."""

MEAN_KL = 1e-2
"""The mean next-token KL against re-prefill the ops a default budget lets stand may reach."""


def calibration_dirs() -> list[Path]:
    """Where calibrations are looked for: the user's directory, then the shipped models'."""
    user = os.environ.get(CALIBRATION_DIR_VARIABLE)
    home = Path(user) if user else Path.home() / ".cache" / "kamera" / "calibration"
    return [home, _SHIPPED]


def _file_name(fingerprint: str) -> str:
    return f"{fingerprint[:32]}.json"


def find_calibration(fingerprint: str) -> Calibration | None:
    """The calibration fitted on the model with this fingerprint, or ``None`` (never another's)."""
    for directory in calibration_dirs():
        path = directory / _file_name(fingerprint)
        if not path.is_file():
            continue
        try:
            calibration = Calibration.from_json(path.read_text())
        except (OSError, ValueError, TypeError):
            continue  # unreadable: as if absent (calibrate again to replace it)
        share = calibration.recompute_share
        if calibration.fingerprint == fingerprint and math.isfinite(calibration.scale) and 0 < share <= 1:
            return calibration
    return None


def save_calibration(calibration: Calibration, directory: Path | None = None) -> Path:
    """File ``calibration`` by its model's fingerprint (default: the user's calibration directory)."""
    target = directory if directory is not None else calibration_dirs()[0]
    target.mkdir(parents=True, exist_ok=True)
    path = target / _file_name(calibration.fingerprint)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(calibration.to_json())
    temporary.replace(path)
    return path
