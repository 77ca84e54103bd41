"""Property tests: random sequences of window operations, over one window, forks and shared stores.

Invariants checked after every step, on 4-layer models that condition measurably (a 2-layer
model hides every bug that flows through a second layer of conditioning), on both backends:

(a) under the exact settings, every chunk's KV is within 2e-5 of the engine's own re-prefill of
    the window and the answer's next-token KL is below 1e-9;
(b) under any settings, every chunk's KV is what its state says it encodes (`StateOracle`:
    the engine's own prefill behind exactly the recorded chain of antecedent states);
(c) both hold over forks and over two windows sharing one small store (entries get dropped, so
    recalls re-encode), where a patch formed in one window is found by the other;
(d) never costlier than a prefix cache: under the exact settings every op prefills at most what
    re-prefilling from its first changed slot does (the tokens from the first slot whose content
    differs, counted by content key, independently of the planner); under any settings every op
    prefills at most the whole window once, and the window's running total never exceeds the
    prefix cache's (what an op defers, like a lazy patch or a survivor's kept conditioning,
    is paid later, never more than once), in small stores that drop entries too.

Also: the graph is acyclic, causal (an edge out of order only into a survivor that stood, naming
its antecedent's earlier state) and matches the window; no chunk is lost unless forgotten;
``plan()`` changes nothing (state, stats, store); a failing op leaves window and store as they
were. Sequences are derandomized so CI sees the same ones; set KAMERA_HYPOTHESIS_RANDOM=1 to
explore new ones.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.backends.decoding import decoded_tokens
from kamera_agent.config import WindowConfig
from kamera_agent.core.identity import ChunkState
from kamera_agent.errors import KameraError
from kamera_agent.fidelity import CALIBRATION_DIR_VARIABLE
from kamera_agent.results import Answer
from kamera_agent.store import ChunkStore
from kamera_agent.window import ChunkRef, KameraWindow
from tests.window.backends import backend_named
from tests.window.helpers import (
    answer_gap,
    calibrate_for_tests,
    chunk_errors,
    chunk_errors_in_order,
    right_to_left_edges,
)
from tests.window.oracle import StateOracle

T = TypeVar("T")
TEXTS = ["red", "green ball", "blue box moves", "a cat", "the dog sat", "yellow", "red"]
EXACT_KV, APPROX_KV, EXACT_KL, EXACT_LOGIT = 2e-5, 1e-4, 1e-9, 1e-4
SMALL_STORE = 60_000  # a few chunks' canonicals and patches: entries are dropped, recalls re-encode
SHARED_STORE = 1 << 24  # holds a whole sequence: what one window stored, the other finds
STORE_TOKEN = 1024
"""The KV bytes per token the store sizes are for (the 4-layer tiny models'); a larger model's
stores are scaled by its own, so they hold as many tokens."""

ANY_SETTINGS: list[dict[str, Any]] = [
    {"rank": 4, "capacity_chunks": 5},
    {"rank": "full", "capacity_chunks": 4},
    {
        "rank": 4,
        "capacity_chunks": 4,
        "patch_mode": "lazy",
        "recall_context": "current",
        "cascade": "keep",
        "reorder": "keep",
        "eviction": "lru",
        "survivors": "removal",
        "orbit": False,
    },
    {"rank": 2, "capacity_chunks": 5, "reorder": "revert", "max_evicted": 3},
    {"rank": 4, "capacity_chunks": 3, "eviction": "disposable", "max_new_tokens": 1},
    {"rank": 0, "capacity_chunks": 4},
]
"""Settings whose approximations the tests exercise unbounded (``drift_budget=None``; a budget on a
random model, with no calibration, would run them exactly), and with a budget (`BUDGETED`)."""
for _settings_ in ANY_SETTINGS:
    _settings_.setdefault("drift_budget", None)
BUDGET = 0.05
ANSWER_BUDGET = 1.0


class WindowMachine(RuleBasedStateMachine):
    """Random ops on a pool of windows over one backend and one small shared store."""

    backend_name: ClassVar[str] = "qwen2"
    exact: ClassVar[bool] = False
    shared: ClassVar[bool] = False
    roomy: ClassVar[bool] = False
    """A store that holds a whole sequence (what the shared windows get too): nothing is dropped."""
    budgeted: ClassVar[bool] = False
    """Each setting with a drift budget (a calibration filed for the backend by the test)."""
    answered: ClassVar[bool] = False
    """With ``budgeted``: the budget in answer units (`WindowConfig.answer_budget`, no calibration)."""
    costs_checked: ClassVar[bool] = True
    """Whether each op is checked never to prefill more than a prefix cache (see `TestAnyAnsweredQwen2`)."""

    @initialize(
        choice=st.integers(0, len(ANY_SETTINGS) - 1),
        first=st.lists(st.sampled_from(TEXTS), min_size=2, max_size=4),
    )
    def setup(self, choice: int, first: list[str] | None = None) -> None:
        self.backend = backend_named(self.backend_name)
        budget_setting = {"answer_budget": ANSWER_BUDGET} if self.answered else {"drift_budget": BUDGET}
        settings_ = {**ANY_SETTINGS[choice], **(budget_setting if self.budgeted else {})}
        if self.budgeted and not self.answered:
            calibrate_for_tests(self.backend.fingerprint, _CALIBRATIONS)
        self.config = WindowConfig.exact(capacity_chunks=4) if self.exact else WindowConfig(**settings_)
        budget = SHARED_STORE if self.shared or self.roomy else SMALL_STORE
        budget *= max(1, self.backend.layout.bytes_per_token(self.backend.dtype) // STORE_TOKEN)
        self.store = ChunkStore(fingerprint=self.backend.fingerprint, memory_limit=budget)
        count = 2 if self.shared else 1
        self.windows = [
            KameraWindow(self.backend, config=self.config, store=self.store) for _ in range(count)
        ]
        self.pushed: list[set[ChunkRef]] = [set() for _ in range(count)]
        self.costs = [_Costs() for _ in range(count)]
        self.oracle = StateOracle(self.backend)
        self.touched = 0
        self.history: list[str] = []  # every text pushed, in order, over all windows
        for text in first or []:  # sequences start from a filled window: fewer steps to the bugs
            self._push(0, text)

    def pick(self, data: st.DataObject) -> int:
        self.touched = data.draw(st.integers(0, len(self.windows) - 1)) if len(self.windows) > 1 else 0
        return self.touched

    # -- operations ----------------------------------------------------------------------------
    @rule(data=st.data(), text=st.sampled_from(TEXTS))
    def push(self, data: st.DataObject, text: str) -> None:
        self._push(self.pick(data), text)

    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """Agents re-read what they read before: push a run of earlier texts again, in order, so
        that stored patches are found again (in this window or another one sharing the store)."""
        if len(self.history) < 2:
            return
        i = self.pick(data)
        start = data.draw(st.integers(0, len(self.history) - 2))
        for text in self.history[start : start + data.draw(st.integers(2, 3))]:
            self._push(i, text)

    @rule(data=st.data())
    def mirror(self, data: st.DataObject) -> None:
        """Another agent starts over on what a window holds now: a fresh window over the same
        store (or an emptied one) pushes its chunks in order. They arrive with fresh antecedents
        where the source's may still encode chunks that left it, so a patch formed over those
        must not be found here (the issue's repro, generalised)."""
        source = self.windows[data.draw(st.integers(0, len(self.windows) - 1))]
        texts = [ref.label for ref in source.refs]
        if len(self.windows) < 4:
            self.windows.append(KameraWindow(self.backend, config=self.config, store=self.store))
            self.pushed.append(set())
            self.costs.append(_Costs())
            i = len(self.windows) - 1
        else:
            i = self.pick(data)
            self._op(i, lambda w: w.slide(len(w)))
        for text in texts:
            self._push(i, text)

    def _push(self, i: int, text: str) -> None:
        ref = self._op(i, lambda w: w.push(text, label=text))
        self.oracle.know(self.windows[i].chunk(ref))
        self.pushed[i].add(ref)
        self.history.append(text)

    def _op(self, i: int, do: Callable[[KameraWindow], T]) -> T:
        """Run one window op on window ``i`` and check what it prefilled against a prefix cache."""
        w, costs = self.windows[i], self.costs[i]
        before = [w.chunk(ref).key for ref in w.refs]
        ops = sum(w.stats.ops.values())
        result = do(w)
        # every state a chunk holds after an op, learned before the next op can replace it: an
        # orbit keeps the digests of all the states merged into it, held at a check or not
        self.oracle.learn(w)
        if sum(w.stats.ops.values()) == ops:
            return result  # nothing ran (an empty slide)
        cost = w.stats.last
        spent = cost.tokens_prefilled
        if isinstance(result, Answer):  # the question and the answer's steps: a prefix cache pays those too
            asked = int(w.query_ids("What is it?").shape[0]) + decoded_tokens(result)
            costs.read += asked
            spent -= asked
        after = [w.chunk(ref) for ref in w.refs]
        same = next(
            (k for k, (a, b) in enumerate(zip(before, after, strict=False)) if a != b.key),
            min(len(before), len(after)),
        )
        prefix = sum(chunk.num_tokens for chunk in after[same:])
        anchor = 0
        if cost.forwards and not costs.anchored:  # a prefix cache prefills the anchor once too
            anchor, costs.anchored = w.encoder.anchor().num_tokens, True
        costs.prefix += prefix + anchor
        if cost.probes:  # decodes a probe-driven eviction spends by choice: counted apart
            costs.probed += spent
            return result
        if self.budgeted:  # the budget's audits are its estimator's cost, not a chunk's prefill
            spent -= cost.audit_tokens
            lazy = w.config.patch_mode == "lazy" and not isinstance(result, Answer)
            for ref in [] if lazy else w.refs:  # lazily deferred patches: kept by the read forming them
                drift = w.drift_of(ref)
                assert drift is not None and w.budget is not None and drift <= w.budget, (ref, drift)
        if not self.costs_checked:
            return result
        if self.exact or self.budgeted:
            assert spent <= prefix + anchor, (w.stats.last, w.last_plan, before, [c.key for c in after])
        else:
            assert spent <= sum(chunk.num_tokens for chunk in after) + anchor, (w.stats.last, w.last_plan)
        window_total = w.stats.total.tokens_prefilled - costs.read - costs.probed - w.stats.total.audit_tokens
        assert window_total <= costs.prefix, (window_total, costs.prefix, w.last_plan)
        return result

    @rule(data=st.data())
    def reorder(self, data: st.DataObject) -> None:
        i = self.pick(data)
        if len(self.windows[i]) > 1:
            order = data.draw(st.permutations(self.windows[i].refs))
            self._op(i, lambda w: w.reorder(order))

    @rule(data=st.data(), text=st.sampled_from(TEXTS))
    def advance(self, data: st.DataObject, text: str) -> None:
        """A stream's step: the oldest chunk slides out, a new one comes in (its left context is
        the survivors, which by default still encode the chunk that left)."""
        i = self.pick(data)
        if len(self.windows[i]):
            self._op(i, lambda w: w.slide(1))
        self._push(i, text)

    @rule(data=st.data(), n=st.integers(0, 2))
    def slide(self, data: st.DataObject, n: int) -> None:
        i = self.pick(data)
        before = self.windows[i].refs
        n = min(n, len(before))  # sliding more than the window holds is refused (test_bad_inputs)
        assert self._op(i, lambda w: w.slide(n)) == before[:n]

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        i = self.pick(data)
        if len(self.windows[i]):
            ref = data.draw(st.sampled_from(self.windows[i].refs))
            self._op(i, lambda w: w.evict(ref))

    @rule(data=st.data())
    def recall(self, data: st.DataObject) -> None:
        i = self.pick(data)
        w = self.windows[i]
        if not w.evicted:
            return
        ref = data.draw(st.sampled_from(sorted(w.evicted)))
        full = w.config.capacity_chunks is not None and len(w) >= w.config.capacity_chunks
        at = data.draw(st.none() | st.integers(0, len(w) - int(full)))
        self._op(i, lambda w: w.recall(ref, at=at))
        assert ref in w.refs

    @rule(data=st.data())
    def ask(self, data: st.DataObject) -> None:
        i = self.pick(data)
        if len(self.windows[i]):
            self._op(i, lambda w: w.ask("What is it?", decode=DecodeConfig(max_new_tokens=1)))

    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        i = self.pick(data)
        w = self.windows[i]
        if w.evicted:
            ref = data.draw(st.sampled_from(sorted(w.evicted)))
            w.forget(ref)
            self.pushed[i].discard(ref)

    @precondition(lambda self: len(self.windows) < 4)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        i = self.pick(data)
        branch = self.windows[i].fork()
        self.windows.append(branch)
        self.pushed.append(set(self.pushed[i]))
        self.costs.append(replace(self.costs[i]))
        if branch.refs:
            self._op(len(self.windows) - 1, lambda w: w.slide())  # the branch's edits stay in the branch
        assert self.windows[i].refs != branch.refs or not branch.refs

    @precondition(lambda self: self.shared and len(self.windows) < 4)
    @rule()
    def another_window(self) -> None:
        self.windows.append(KameraWindow(self.backend, config=self.config, store=self.store))
        self.pushed.append(set())
        self.costs.append(_Costs())

    # -- what must never change --------------------------------------------------------------
    @rule(data=st.data(), op=st.sampled_from(["push", "reorder", "slide", "evict", "recall"]))
    def plan_is_a_dry_run(self, data: st.DataObject, op: str) -> None:
        w = self.windows[self.pick(data)]
        before = self._snapshot(w)
        try:
            if op == "push":
                w.plan("push", data.draw(st.sampled_from(TEXTS)))
            elif op == "reorder" and w.refs:
                w.plan("reorder", list(reversed(w.refs)))
            elif op == "slide":
                w.plan("slide", 1)
            elif op == "evict" and w.refs:
                w.plan("evict", w.refs[0])
            elif op == "recall" and w.evicted:
                w.plan("recall", sorted(w.evicted)[0], at=0)
        except KameraError:
            pass
        assert self._snapshot(w) == before

    @rule(
        data=st.data(), bad=st.sampled_from(["recall-in-window", "duplicate", "foreign", "forget-in-window"])
    )
    def failing_op_changes_nothing(self, data: st.DataObject, bad: str) -> None:
        w = self.windows[self.pick(data)]
        before = self._snapshot(w)
        try:
            if bad == "recall-in-window" and w.refs:
                w.recall(w.refs[0])
            elif bad == "duplicate" and w.refs:
                w.reorder([w.refs[0], *w.refs])
            elif bad == "forget-in-window" and w.refs:
                w.forget(w.refs[0])
            else:
                stranger = KameraWindow(self.backend, config=WindowConfig(rank=4))
                w.evict(stranger.push("stranger"))
        except KameraError:
            pass
        assert self._snapshot(w) == before

    def _snapshot(self, w: KameraWindow) -> tuple[Any, ...]:
        stats = self.store.stats()
        return (
            w.refs,
            sorted(w.evicted),
            sorted((a, b, d["state"]) for a, b, d in w.graph.edges(data=True)),
            [w.state_of(r).digest for r in w.refs],
            w.stats,
            sorted(self.store.keys()),
            (stats.puts, stats.hits, stats.misses),
        )

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def every_chunk_is_what_its_state_says(self) -> None:
        if not hasattr(self, "windows"):
            return
        for w in self.windows:
            self.oracle.learn(w)
        for w, costs in zip(self.windows, self.costs, strict=True):
            spent = w.stats.total.tokens_prefilled
            errors = self.oracle.errors(w)
            costs.read += w.stats.total.tokens_prefilled - spent
            for label, (error, state) in errors.items():
                bound = EXACT_KV if state.exact else APPROX_KV
                assert error <= bound, (label, state, error)
            if self.budgeted and w.refs:  # what the budget calls exact (estimate 0) is
                spent = w.stats.total.tokens_prefilled
                truth = chunk_errors_in_order(w)  # by slot: labels repeat
                costs.read += w.stats.total.tokens_prefilled - spent
                for ref, error in zip(w.refs, truth, strict=True):
                    if w.drift_of(ref) == 0.0:
                        assert error <= EXACT_KV, (ref, truth, w.last_plan)

    @invariant()
    def exact_settings_answer_like_a_reprefill(self) -> None:
        if not self.exact or not hasattr(self, "windows"):
            return
        w = self.windows[self.touched]
        if w.refs:
            spent = w.stats.total.tokens_prefilled
            errors = chunk_errors(w)
            assert max(errors.values()) <= EXACT_KV, errors
            kl, gap = answer_gap(w)
            assert kl < EXACT_KL and gap <= EXACT_LOGIT, (kl, gap)
            self.costs[self.touched].read += w.stats.total.tokens_prefilled - spent  # this check's own reads

    @invariant()
    def graph_is_acyclic_causal_and_matches_the_window(self) -> None:
        if not hasattr(self, "windows"):
            return
        for w, pushed in zip(self.windows, self.pushed, strict=True):
            graph = w.graph
            # Over time a ref's state changes, so refs may cycle through an evicted chunk (b kept
            # a state that encoded c's old state; c now encodes b). In the window an edge points
            # left to right, except (under a budget) into a survivor that stood when a chunk it
            # had absorbed came back to its right: that edge names the state the chunk had then,
            # which encodes nothing of the survivor (`right_to_left_edges` checks it). So states
            # never cycle, and the window's refs only through those edges.
            stood = right_to_left_edges(w)
            assert not stood or w.budget is not None, "a KV may only encode chunks to its left"
            assert set(graph.nodes) == set(w.refs) | set(w.evicted)
            for _, target, recorded in graph.edges(data="state"):
                if w.state_of(target).kind != "orbit":  # an orbit encodes a set, not a chain
                    assert recorded in _encoded(w.state_of(target))
            known = set(w.refs) | set(w.evicted)
            assert known <= pushed  # nothing appears from nowhere
            lost = pushed - known
            assert len(lost) <= w.stats.total.forgotten, "a chunk left the window's record unreported"
            assert len(w.refs) <= (w.config.capacity_chunks or len(w.refs))

    def teardown(self) -> None:
        if not hasattr(self, "windows"):
            return
        w = self.windows[0]
        for ref in sorted(w.evicted):  # every evicted chunk comes back
            try:
                self._op(0, lambda w, ref=ref: w.recall(ref))
            except KameraError as exc:  # only a released image can be lost, and it says so
                raise AssertionError(f"{ref} could not be recalled: {exc}") from exc
            assert ref in w.refs


@dataclass
class _Costs:
    """One window's running totals beside a prefix cache's over the same ops."""

    prefix: int = 0
    read: int = 0
    """Tokens of questions, answers and this test's own reads (a canonical a check of a lazily
    deferred chunk prefills): a prefix cache's ops pay none of them either."""
    probed: int = 0
    anchored: bool = False


def _encoded(state: ChunkState) -> set[str]:
    """The digests of the states whose KV ``state``'s KV encodes: its context's, and a recomputed
    state's source's (its other tokens kept what they encoded)."""
    encoded = {s.digest for s in state.context.states()}
    if state.source is not None:
        encoded |= {state.source.digest} | _encoded(state.source)
    return encoded


def _settings(examples: int, steps: int = 12) -> settings:
    derandomize = os.environ.get("KAMERA_HYPOTHESIS_RANDOM") != "1"
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def _machine(
    backend: str,
    exact: bool,
    shared: bool,
    roomy: bool = False,
    budgeted: bool = False,
    answered: bool = False,
) -> type[WindowMachine]:
    kind = ("Exact" if exact else "Any") + ("Shared" if shared else "") + ("Roomy" if roomy else "")
    name = (
        kind + ("Answered" if answered else "Budgeted" if budgeted else "") + backend.title().replace("_", "")
    )
    attributes = {"backend_name": backend, "exact": exact, "shared": shared, "roomy": roomy}
    return type(
        name, (WindowMachine,), {**attributes, "budgeted": budgeted or answered, "answered": answered}
    )


_CALIBRATIONS = Path(tempfile.mkdtemp(prefix="kamera-calibrations-"))


@pytest.fixture(autouse=True)
def _calibrations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Budgeted machines find the calibrations they file for their backends here."""
    monkeypatch.setenv(CALIBRATION_DIR_VARIABLE, str(_CALIBRATIONS))


TestExactQwen2 = _machine("qwen2", True, False).TestCase
TestExactQwen2.settings = _settings(150)
TestAnyQwen2 = _machine("qwen2", False, False).TestCase
TestAnyQwen2.settings = _settings(300)
TestSharedQwen2 = _machine("qwen2", False, True).TestCase
TestSharedQwen2.settings = _settings(150)
TestExactSharedQwen2 = _machine("qwen2", True, True).TestCase
TestExactSharedQwen2.settings = _settings(80)
TestExactTinyTorch = _machine("tiny_torch", True, False).TestCase
TestExactTinyTorch.settings = _settings(150)
TestAnyTinyTorch = _machine("tiny_torch", False, False).TestCase
TestAnyTinyTorch.settings = _settings(300)
TestSharedTinyTorch = _machine("tiny_torch", False, True).TestCase
TestSharedTinyTorch.settings = _settings(150)
TestExactSharedTinyTorch = _machine("tiny_torch", True, True).TestCase
TestExactSharedTinyTorch.settings = _settings(80)
# (d) also where the store drops nothing: with the ones above, 380 exact and 600 other sequences a backend
TestExactRoomyQwen2 = _machine("qwen2", True, False, roomy=True).TestCase
TestExactRoomyQwen2.settings = _settings(150)
TestAnyRoomyQwen2 = _machine("qwen2", False, False, roomy=True).TestCase
TestAnyRoomyQwen2.settings = _settings(150)
TestExactRoomyTinyTorch = _machine("tiny_torch", True, False, roomy=True).TestCase
TestExactRoomyTinyTorch.settings = _settings(150)
TestAnyRoomyTinyTorch = _machine("tiny_torch", False, False, roomy=True).TestCase
TestAnyRoomyTinyTorch.settings = _settings(150)
# sliding-window layers beside global ones, two rotary bases (Gemma 3's shape), windows reaching far
# past the sliding window; and a real model (SmolLM2-135M-Instruct): every answer within 1e-4 in logits
TestExactGemma3 = _machine("gemma3", True, False).TestCase
TestExactGemma3.settings = _settings(60)
TestAnyGemma3 = _machine("gemma3", False, False).TestCase
TestAnyGemma3.settings = _settings(60)
# a drift budget over every setting: each op within ε by the estimate, never costlier, estimate 0 exact
# (in stores that drop nothing: a small store's dropped canonical is re-formed unplanned, budget or not)
TestAnyBudgetedQwen2 = _machine("qwen2", False, False, roomy=True, budgeted=True).TestCase
TestAnyBudgetedQwen2.settings = _settings(100)
TestSharedBudgetedTinyTorch = _machine("tiny_torch", False, True, budgeted=True).TestCase
TestSharedBudgetedTinyTorch.settings = _settings(60)
# the budget in answer units: a random model's answers have no margin, so most verdicts re-prefill
# and some stand (an answer budget of 1): every state what it says, each op within the budget by
# the estimate, estimate 0 exact. Not the prefix-cache bound: `test_an_answer_budget_is_never_costlier`.
_Answered = _machine("qwen2", False, False, roomy=True, answered=True)
TestAnyAnsweredQwen2 = type("AnyAnsweredQwen2", (_Answered,), {"costs_checked": False}).TestCase
TestAnyAnsweredQwen2.settings = _settings(60)


@pytest.mark.xfail(
    strict=True,
    reason="known gap (issue 51): where an op moves chunks a verdict repaired, or changes their left, "
    "and no verdict covers them there, the planner re-prefills from them (e.g. a recall among chunks "
    "of one content), left of the first slot whose content changed, which a prefix cache reuses",
)
def test_an_answer_budget_is_never_costlier() -> None:
    """The answered machine with every op's tokens checked against a prefix cache's (no shrinking:
    the first failure is the answer)."""
    run_state_machine_as_test(
        _Answered, settings=settings(_settings(60), phases=[Phase.explicit, Phase.generate])
    )


def test_exact_windows_on_a_real_model_answer_like_its_own_forward_over_random_ops() -> None:
    """SmolLM2-135M-Instruct (30 layers, GQA, its own chat template): random ops under the exact
    settings, each step's answer within 1e-4 in every logit of the model's own re-prefill."""
    checked: list[float] = []

    class Counted(_machine("smollm2", True, False)):  # type: ignore[misc,valid-type]
        @invariant()
        def exact_settings_answer_like_a_reprefill(self) -> None:
            super().exact_settings_answer_like_a_reprefill()
            if hasattr(self, "windows") and self.windows[self.touched].refs:
                checked.append(1.0)

    run_state_machine_as_test(Counted, settings=_settings(6))
    assert len(checked) >= 50, len(checked)


def test_budget_forced_re_encodes_are_reported() -> None:
    backend = backend_named("qwen2")
    store = ChunkStore(fingerprint=backend.fingerprint, memory_limit=25_000)
    w = KameraWindow(backend, config=WindowConfig(rank=4), store=store)
    refs = [w.push(text, label=text) for text in TEXTS[:6]]
    w.slide(len(refs))
    for ref in refs:
        w.recall(ref)
    assert w.stats.total.reforms > 0
    assert w.refs == refs
