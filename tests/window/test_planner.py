"""Unit tests of the pure planner on the plain-torch backend: its rules, read off states and a view.

The planner sees a window state and a `StoreView` that can only answer presence questions (a
spy here: it has no way to load an entry or run the model), so each rule can be checked in
isolation, including what the chained states change: a stored patch is found only over the
antecedent states it was formed over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kamera_agent.config import WindowConfig
from kamera_agent.core.identity import ChunkState, Context
from kamera_agent.window import ChunkRef, KameraWindow
from kamera_agent.window.plan import WindowPlan
from kamera_agent.window.planner import PlanInputs, Planner
from tests.window.backends import backend_named


@dataclass
class SpyView:
    """A store view that holds given patch variants and canonicals, and records every question."""

    patches: set[tuple[str, str]] = field(default_factory=set)
    fulls: set[tuple[str, str]] = field(default_factory=set)
    canonicals: set[str] = field(default_factory=set)
    asked: list[str] = field(default_factory=list)

    def has_canonical(self, key: str) -> bool:
        self.asked.append("canonical")
        return key in self.canonicals

    def has_vision(self, key: str) -> bool:
        return False

    def has_full(self, chunk_key: str, state: str) -> bool:
        self.asked.append("full")
        return (chunk_key, state) in self.fulls

    def has_patch(self, chunk_key: str, variant: str) -> bool:
        self.asked.append("patch")
        return (chunk_key, variant) in self.patches

    def patch_info(self, chunk_key: str, variant: str) -> tuple[str, dict[str, str]] | None:
        self.asked.append("info")
        return None

    def fits(self, nbytes: int) -> bool:
        return True


def window(**config: object) -> KameraWindow:
    return KameraWindow(
        backend_named("tiny_torch"), config=WindowConfig(drift_budget=None, **{"rank": "full", **config})
    )  # type: ignore[arg-type]


def planner(w: KameraWindow, view: SpyView, **config: object) -> Planner:
    backend = w.backend
    inputs = PlanInputs(
        config=w.config.model_copy(update=config),
        view=view,
        root=Context.root(w.encoder.anchor().key),
        features=backend.layout.features,
        kv_bytes_per_token=backend.layout.bytes_per_token(backend.dtype),
    )
    return Planner(inputs)


def step_of(plan: WindowPlan, ref: ChunkRef) -> str:
    return next(step.kind for step in plan.steps if step.ref == ref and step.kind != "form_canonical")


def test_a_stored_patch_is_found_only_over_the_states_it_was_formed_over() -> None:
    survivor = window()
    for text in ("a first", "a second", "a third"):
        survivor.push(text)
    survivor.slide()  # "a second" and "a third" survive, still encoding "a first"
    fresh = window()
    b, c = fresh.push("a second"), fresh.push("a third")  # the same content, encoding nothing else
    d = fresh.encoder.text("a fourth")
    natural = ChunkState.patched(d.key, "full", _context(fresh, [b, c]))
    view = SpyView(fulls={(d.key, natural.digest)})  # a full-rank state is stored as its KV
    new = survivor._runner.state.mint(d, None)
    assert step_of(planner(survivor, view).push(survivor._runner.state, d, None), new) == "form_patch"
    new = fresh._runner.state.mint(d, None)
    assert step_of(planner(fresh, view).push(fresh._runner.state, d, None), new) == "apply_patch"


def test_a_reorder_with_the_same_set_but_another_chain_forms_a_patch() -> None:
    w = window(orbit=False)
    a, b, c = (w.push(text) for text in ("a first", "a second", "a third"))
    natural = ChunkState.patched(c.key, "full", _context(w, [a, b]))
    plan = planner(w, SpyView(fulls={(c.key, natural.digest)})).reorder(w._runner.state, [b, a, c])
    assert step_of(plan, c) == "form_patch"  # over (b, a|b): another chain than the stored one


def test_a_reorder_onto_the_same_states_relinks_edges_to_the_chunks_now_holding_them() -> None:
    w = window()
    first, second = w.push("the same text"), w.push("the same text")  # same content, two refs
    third = w.push("after them")
    plan = planner(w, SpyView()).reorder(w._runner.state, [second, first, third])
    step = next(s for s in plan.steps if s.ref == third)
    assert step.kind == "rotate" and step.antecedents == (second, first)


def test_a_deferred_chunk_is_formed_first_when_a_chunk_to_its_right_is_patched_over_it() -> None:
    w = window(patch_mode="lazy")
    a, b = w.push("left chunk"), w.push("pending one")
    assert w._runner.state.entries[b].pending
    c = w.push("right chunk")
    w.kv()  # both formed now
    w.evict(a)
    w.recall(a, at=0)  # cascade: b and c are re-patched over a, so nothing is pending
    d = w.push("pending again")
    plan = planner(w, SpyView()).reorder(w._runner.state, [a, b, d, c])
    d_step = next(s for s in plan.steps if s.ref == d)
    assert d_step.kind == "form_patch" and "formed first" in d_step.detail


def test_consecutive_formations_share_one_forward_and_record_what_it_computes() -> None:
    w = window()
    refs = [w.push(f"chunk number {i}") for i in range(4)]
    order = [refs[0], refs[3], refs[1], refs[2]]
    full = planner(w, SpyView()).reorder(w._runner.state, order)
    forms = [s for s in full.steps if s.kind == "form_patch"]
    assert [s.in_run for s in forms] == [False, True, True] and full.public().forwards == 1
    assert forms[1].state.context.last == forms[0].state  # lossless: the run is the natural chain
    stored = SpyView(canonicals={ref.key for ref in refs})
    truncated = planner(w, stored, rank=2, orbit=False).reorder(w._runner.state, order)
    forms = [s for s in truncated.steps if s.kind == "form_patch"]
    public = truncated.public()  # the canonicals are stored: rank-2 patches against them
    assert public.forwards == 1 and public.count("form_canonical") == 0 and forms[0].state.rank == 2
    # One forward conditions each member on the previous one's exact KV, not on its rank-2 patch:
    previous = forms[1].state.context.last
    assert previous is not None and previous.rank == "full" and previous != forms[0].state
    # No canonical stored: each formation keeps the exact KV its forward gave (no second forward).
    bare = planner(w, SpyView(), rank=2, orbit=False).reorder(w._runner.state, order)
    forms = [s for s in bare.steps if s.kind == "form_patch"]
    assert bare.public().forwards == 1 and bare.public().count("form_canonical") == 0
    assert all(step.state.rank == "full" for step in forms)


def test_planning_asks_the_view_only_presence_questions() -> None:
    w = window(orbit=True)
    refs = [w.push(f"piece {i}") for i in range(3)]
    view = SpyView()
    planner(w, view).reorder(w._runner.state, list(reversed(refs)))
    planner(w, view).push(w._runner.state, w.encoder.text("one more"), None)
    assert set(view.asked) <= {"canonical", "full", "patch", "info"} and view.asked


def _context(w: KameraWindow, refs: list[ChunkRef]) -> Context:
    ctx = Context.root(w.encoder.anchor().key)
    for ref in refs:
        ctx = ctx.extend(w.state_of(ref))
    return ctx
