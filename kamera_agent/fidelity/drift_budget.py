"""The drift budget: every chunk's estimated drift kept within ε, by windows and engines alike.

Why here and in this shape: the planner approximates where the window's policies say (kept
survivors, orbit patches, recalls in their original context, rank-m patches); the budget bounds
what those approximations may cost in fidelity. After an op runs, each chunk the window does not
hold exactly is given an estimate (`kamera_agent.fidelity`: a sampled audit, scaled by the
model's calibration, plus a share of the largest estimate to its left); the first chunk over ε
is fixed, the cheapest fix that holds first (`kamera_agent.window.drift_fixes`), at worst by
re-prefilling it and every chunk after it over their left context, which makes them exact
there. An audit is remembered by what the chunk's KV and its left context
encode (their chained digests), so a chunk is audited once per arrangement it is served in; it
is also filed in the store (`DriftAudit`), so windows of other processes and nodes sharing the
store, and engine adapters, which cannot audit, read it instead of measuring it again.

The planner keeps the never-costlier rule with the budget on: before an op runs it bounds what
the fix could cost (a re-prefill from the first chunk it cannot already vouch for, and the
audits), and where the plan with that fix could prefill more than re-prefilling from the op's
first changed slot, it plans that re-prefill instead; and where the plan, its audits and the
share of that bound such ops have spent on fixes (their **fix share**) are expected to cost more
than the re-prefill, it plans the re-prefill too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Literal

from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.fidelity.answer import combined
from kamera_agent.fidelity.audits import Filed, Measure
from kamera_agent.fidelity.calibration import Calibration
from kamera_agent.fidelity.vouching import vouch_class

__all__ = ["DriftBudget", "Units"]

Units = Literal["kv", "answer"]
"""What a budget's ε bounds: each chunk's estimated relative KV error (audits scaled by the
model's calibration), or the window's next-token KL against a re-prefill, estimated from a probe's
answer (`kamera_agent.fidelity.answer`; windows only: an engine cannot decode a probe)."""

_AUDITS = 1 << 14  # audits remembered per budget
_RETRY = 16  # an op name whose approximations keep failing is still tried once in this many
_EVIDENCE = 4  # answer verdicts of an op name measured before their least estimate forecasts one
_KIND = {"evict": "slide"}
"""Op names counted as another's: an eviction leaves what a slide leaves (survivors keeping what
they absorbed from the chunks that left), so how often one needed a fix tells about the other."""
_PRIOR = 8  # a calibration's fix shares count as at most this many ops (the window's own outweigh them)


class DriftBudget:
    """ε, the model's calibration and the audits measured so far (shared by a window's forks:
    an audit depends only on the digests it is filed by)."""

    def __init__(self, epsilon: float, calibration: Calibration, units: Units = "kv") -> None:
        self.epsilon, self.calibration, self.units = epsilon, calibration, units
        self._audits: OrderedDict[tuple[str, str], float] = OrderedDict()
        # per op name: [audited ops, the shares of their fix bounds their fixes spent, summed],
        # from the calibration's episodes at first
        self._outcomes: dict[str, list[float]] = {
            op: _prior(*counts) for op, counts in calibration.fix_shares.items()
        }
        self._skipped: dict[str, int] = {}
        self._least: dict[str, tuple[int, float]] = {}  # per op name: answer verdicts measured, their least
        self._hopeless: dict[str, int] = {}  # per op name: answer verdicts expected to refuse
        self._lock = threading.Lock()
        self.always_try = False
        """Try every op's approximations whatever its fix share (a measurement that must see each
        op's outcome: a name ruled out after two fixes would be measured on two ops)."""

    def record(self, op: str, spent: float) -> None:
        """Remember what share of its fix bound an op whose approximations were audited spent on
        fixes (0: it stood as planned; 1: its fixes cost what the bound allowed for; a fix tried
        alone, such as a token recompute, records 1 where it failed and 0 where it held)."""
        with self._lock:
            seen = self._outcomes.setdefault(_KIND.get(op, op), [0, 0.0])
            seen[0] += 1
            seen[1] += min(1.0, max(0.0, float(spent)))
            self._skipped[_KIND.get(op, op)] = 0

    def outcomes(self) -> dict[str, tuple[int, float]]:
        """Per op name: ``(ops audited, their fix shares summed)`` (a calibration's included)."""
        with self._lock:
            return {op: (int(seen[0]), seen[1]) for op, seen in self._outcomes.items()}

    def declined(self, op: str) -> None:
        """Remember that an op of this name was re-prefilled without trying its approximations."""
        with self._lock:
            kind = _KIND.get(op, op)
            self._skipped[kind] = self._skipped.get(kind, 0) + 1

    def measured(self, op: str, estimate: float) -> None:
        """Remember what an answer verdict on an op of this name estimated its approximations at."""
        with self._lock:
            kind = _KIND.get(op, op)
            count, least = self._least.get(kind, (0, estimate))
            self._least[kind] = (count + 1, min(least, estimate))

    def least(self, op: str) -> float:
        """The least estimate an answer verdict on an op of this name has measured (0 before any)."""
        with self._lock:
            return self._least.get(_KIND.get(op, op), (0, 0.0))[1]

    def hopeless(self, op: str, room: float) -> bool:
        """Whether an answer verdict on an op of this name, with ``room`` left by the verdicts
        before it, is expected to refuse: ``room`` is under the least estimate of the `_EVIDENCE`
        or more such ops measured, so measuring would be paid for nothing. Every `_RETRY`-th is
        measured anyway: a few large estimates do not rule the name out for good."""
        with self._lock:
            kind = _KIND.get(op, op)
            count, least = self._least.get(kind, (0, 0.0))
            if count < _EVIDENCE or room >= least:
                return False
            self._hopeless[kind] = self._hopeless.get(kind, 0) + 1
            return self._hopeless[kind] % _RETRY != 0

    def fix_share(self, op: str) -> float:
        """The share of its fix bound an audited op of this name is expected to spend on fixes:
        the mean over the ops counted (the calibration's fitting episodes, then the window's
        own), else 0 before any (the first is tried), one more op counted as standing, so one
        failure does not rule the name out for good."""
        with self._lock:
            audited, spent = self._outcomes.get(_KIND.get(op, op), (0, 0.0))
        return spent / (audited + 1)

    def worth_trying(self, op: str, planned: int, fix: int, refill: int, audits: int) -> bool:
        """Whether approximating is expected to cost fewer tokens than re-prefilling exactly: the
        plan, its audits and the share of its fix bound ``fix`` ops of this name spend, against
        the re-prefill ``refill``. Why the expected share and not how often a fix was needed: a
        fix that re-prefills the one chunk over ε costs a fraction of the bound, so an op that
        needs one nearly every time can still pay. Every `_RETRY`-th op that would not be tried
        is tried anyway, so the share keeps up with what the window holds."""
        if self.always_try:
            return planned + audits < refill
        if planned + audits + self.fix_share(op) * fix < refill:
            return True
        with self._lock:  # read only: planning is a dry run (the runner counts what ran: `declined`)
            return self._skipped.get(_KIND.get(op, op), 0) + 1 >= _RETRY

    def own(self, state: ChunkState, left: Context, filed: Filed | None = None) -> float | None:
        """What the chunk adds itself in ``state`` behind ``left``: 0 where its KV is that forward's
        output over exactly ``left`` (a full-rank state formed there), else its remembered audit,
        else one ``filed`` in the store (by any window, in any process), remembered, else ``None``
        (not measured)."""
        if state.kind == "patched" and state.rank == "full" and state.context.digest == left.digest:
            return 0.0
        if state.kind == "canonical" and left.length == 0:
            return 0.0
        with self._lock:
            known = self._audits.get((state.digest, left.digest))
        if known is None and filed is not None:
            known = filed(state, left)
            if known is not None:
                self.remember(state, left, known)
        return known

    def audited(self) -> list[float]:
        """The audits remembered, oldest first (each chunk's own error, before `Calibration.estimate`
        scales it): what a benchmark reports beside the fixes they led to."""
        with self._lock:
            return list(self._audits.values())

    def remember(self, state: ChunkState, left: Context, audit: float) -> None:
        with self._lock:
            self._audits[(state.digest, left.digest)] = audit
            while len(self._audits) > _AUDITS:
                self._audits.popitem(last=False)

    def estimates(
        self,
        states: Sequence[ChunkState],
        root: Context,
        measure: Measure | None = None,
        until_over: bool = False,
        filed: Filed | None = None,
    ) -> list[float | None]:
        """Each chunk's estimated drift, left to right, in ``states`` behind ``root``: 0 where the
        chain up to it is exact; from an audit remembered or ``filed`` in the store, else from
        ``measure`` (``None`` from the first chunk that is neither, when no ``measure`` is given,
        and after the first over ε with ``until_over``: what a fix re-prefills anyway is not
        audited)."""
        out: list[float | None] = []
        ctx, worst = root, 0.0
        for i, state in enumerate(states):
            following = ctx.extend(state)
            if following.exact:
                estimate = 0.0
            else:
                own = self.own(state, ctx, filed)
                if own is None and measure is not None:
                    own = measure(i, state, ctx)
                    self.remember(state, ctx, own)
                if own is None:
                    return out + [None] * (len(states) - i)
                estimate = self._chained(own, worst)
            out.append(estimate)
            if until_over and not estimate <= self.epsilon:
                return out + [None] * (len(states) - i - 1)
            worst, ctx = max(worst, estimate), following
        return out

    def _chained(self, own: float, inherited: float) -> float:
        """A chunk's estimate from what it adds and the largest estimate to its left: the
        calibration's in KV units; in answer units, the two drifts of the window's answer together
        (an answer verdict files what its op's approximations added)."""
        if self.units == "answer":
            return combined(inherited, own)
        return self.calibration.estimate(own, inherited)

    def vouch(
        self,
        state: ChunkState,
        left: Context,
        inherited: float,
        filed: Filed,
        distance: int | None = None,
        present: Collection[str] | None = None,
    ) -> float | None:
        """The estimated drift of ``state`` served behind ``left``, where the largest estimate to
        its left is ``inherited``, from what is known without measuring: how an engine, which
        cannot audit, decides whether a kept state may be served (within `vouch_epsilon`).

        Where the calibration fitted bounds (`Calibration.vouch_bounds`) and the state's
        ``distance`` from the first approximated chunk and the chunk keys ``present`` in the
        context are given, the estimate is its bound (`kamera_agent.fidelity.vouching`), raised by
        any audit filed for it (`own`) and by what it inherits: an audit only ever tightens what
        the calibration vouches for; loosening takes a new calibration. Without bounds, only a
        filed audit vouches. ``None``: nothing vouches for it."""
        own = self.own(state, left, filed)
        audited = None if own is None else self.calibration.estimate(own, inherited)
        bound = None
        if distance is not None and present is not None:
            bound = self.calibration.vouch_bound(vouch_class(state, present, left), distance)
        if bound is None:
            return audited
        return max(bound, self.calibration.estimate(0.0, inherited), audited or 0.0)

    @property
    def vouch_epsilon(self) -> float:
        """The ε a kept state no window holds is served within: ε, capped by the calibration's
        `Calibration.vouch_budget` where it fitted bounds (the largest ε at which what the
        bounds let stand answered like a re-prefill on its episodes)."""
        if not self.calibration.vouch_bounds:
            return self.epsilon
        return min(self.epsilon, self.calibration.vouch_budget)

    def first_over(self, estimates: Sequence[float | None]) -> int | None:
        """The first index not known to be within ε (over it, or not estimated)."""
        return next((i for i, e in enumerate(estimates) if e is None or not e <= self.epsilon), None)


def _prior(audited: int, spent: float) -> list[float]:
    """A calibration's counts for one op name, scaled down to at most `_PRIOR` ops (same share)."""
    if audited <= _PRIOR:
        return [audited, spent]
    return [_PRIOR, spent * _PRIOR / audited]
