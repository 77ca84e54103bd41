"""Window operations against the model's own re-prefill, their costs, and their errors.

After each op every in-window chunk's KV is compared with what a full re-prefill of the
window's current sequence gives. Ops that keep conditioning exact (relocation only, reorder
with exact per-ordering patches, recall with its stored patch at the same antecedents) match
to float rounding; ops that approximate (survivors after a slide, orbit patches, recall on
the original context) report a KL that is asserted below a stated bound.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

from kamera_agent.backends.base import DecodeConfig
from kamera_agent.config import WindowConfig
from kamera_agent.errors import (
    CapacityError,
    ChunkInWindowError,
    ContextOverflowError,
    DuplicateChunkError,
    UnknownChunkError,
    UnreadableInputError,
    WindowError,
)
from kamera_agent.testing import CountingBackend
from kamera_agent.window import KameraWindow
from tests.backends.test_transformers_backend import images
from tests.kv_helpers import next_token_kl
from tests.window.backends import backend_named
from tests.window.helpers import answer_kl, chunk_errors
from tests.window.oracle import StateOracle

EXACT = 2e-5  # float32 rounding of a re-prefill vs relocated + full-rank patched KV
APPROX_KL = 5e-2  # the tiny sharpened models' bound for approximate ops (measured ~1e-4 .. 1e-2)


Make = Callable[..., KameraWindow]


@pytest.fixture(params=["qwen2_vl", "tiny_torch"])
def make(request: pytest.FixtureRequest) -> Make:
    """Windows over a 4-layer tiny Qwen2-VL (transformers) or the plain-torch backend."""
    backend = backend_named(request.param)

    def window(**config: object) -> KameraWindow:
        settings = {
            "rank": "full",
            "evicted_pixels": "retain",
            **config,
        }  # keep: re-prefills rebuild recalled images
        return KameraWindow(backend, config=WindowConfig(drift_budget=None, **settings))  # type: ignore[arg-type]

    return window


def three(w: KameraWindow) -> list:
    pics = images(2, seed=21)
    return [
        w.push(pics[0], label="a"),
        w.push("the red ball rolled left", label="b"),
        w.push(pics[1], label="c"),
    ]


def assert_exact(w: KameraWindow) -> None:
    errors = chunk_errors(w)
    assert max(errors.values()) <= EXACT, errors
    assert answer_kl(w) < 1e-9


def test_pushes_with_exact_patches_match_reprefill(make: Make) -> None:
    w = make()
    three(w)
    assert_exact(w)
    assert w.stats.ops["push"] == 3


def test_the_anchor_runs_in_the_first_forward_of_a_window(make: Make) -> None:
    """A window's first op prefills the anchor with its first chunks, in one forward, as a
    prefix cache does: as a pushed chunk's canonical, and as a run formed from slot 0."""
    w = make()
    w.push("the red ball rolled left", label="a")
    assert w.stats.last.forwards == 1
    assert w.stats.last.tokens_prefilled == w.encoder.anchor().num_tokens + w.chunk(w.refs[0]).num_tokens
    assert_exact(w)
    v = make()
    v.extend(["the red ball rolled left", "then it stopped by the wall"])
    assert v.stats.last.forwards == 1
    assert_exact(v)


def test_reorder_with_exact_patches_matches_and_reorder_back_runs_no_forward(make: Make) -> None:
    w = make()
    a, b, c = three(w)
    w.reorder([c, a, b])
    assert_exact(w)
    w.reorder([a, b, c])
    assert w.stats.last.forwards == 0 and w.stats.last.patches_applied == 2  # both patches stored
    assert_exact(w)


def test_orbit_patch_serves_a_new_ordering_of_the_same_set_without_a_forward(make: Make) -> None:
    w = make()
    a, b, c = three(w)
    plan = w.plan("reorder", [b, a, c])
    c_edit = next(edit for edit in plan.edits if edit.label == "c")
    assert (c_edit.kind, c_edit.forwards) == ("apply_patch", 0) and "orbit" in c_edit.detail
    w.reorder([b, a, c])
    assert chunk_errors(w)["c"] > EXACT  # the orbit patch approximates this new ordering
    assert answer_kl(w) < APPROX_KL


def test_a_truncated_rank_serves_the_full_orbit_its_pushes_formed(make: Make) -> None:
    """At rank 2 (below every chunk's size) pushes with no canonical stored keep exact KV, so
    their orbit is a mean of exact KVs at full rank: a reorder within the set is served by it."""
    w = make(rank=2)
    a, b, c = three(w)
    assert w.state_of(c).rank == "full"  # new content: its exact KV, no canonical formed
    c_edit = next(edit for edit in w.plan("reorder", [b, a, c]).edits if edit.label == "c")
    assert (c_edit.kind, c_edit.forwards) == ("apply_patch", 0) and "orbit" in c_edit.detail
    w.reorder([b, a, c])  # b reverts (its canonical, computed in a's forward behind it), c: no forward
    assert (w.stats.last.forwards, w.stats.last.patches_applied) == (1, 1)
    assert w.state_of(c).kind == "orbit" and w.state_of(c).rank == "full"
    assert chunk_errors(w)["c"] > EXACT  # the mean over orderings approximates this one
    assert answer_kl(w) < APPROX_KL


def test_a_one_member_orbit_is_filed_once_under_its_member_and_a_second_member_files_the_mean(
    make: Make,
) -> None:
    """An orbit of one ordering is that ordering's KV: stored once (under the member), not twice.
    A second ordering folded in makes a real mean, filed under the two-member orbit's digest."""
    w = make(rank=2)
    a, b, c = three(w)

    def fulls() -> set[str]:
        listed = w.store.keys()
        return {k.variant for k in listed if k.kind == "full" and k.key == c.key}

    member = w.state_of(c)
    assert fulls() == {member.digest}  # c's exact KV behind (a, b), and no copy for its orbit
    w.reorder([b, a, c])
    orbit = w.state_of(c)
    assert orbit.kind == "orbit" and orbit.members == (member.digest,) and orbit.stored_as == member.digest
    assert fulls() == {member.digest}
    other = KameraWindow(w.backend, config=w.config, store=w.store)
    for ref in (b, a, c):  # c formed behind (b, a): its second ordering joins the orbit
        other.push(w.chunk(ref), label=ref.label)
    second = other.state_of(other.refs[2])
    info = w.store.patch_info(c.key, orbit.address)
    assert info is not None and json.loads(info[1]["members"]) == [member.digest, second.digest]
    assert fulls() == {member.digest, second.digest, info[0]}  # the mean, under the orbit's digest


def test_an_ordering_with_stored_exact_kv_is_served_exactly_not_by_its_orbit(make: Make) -> None:
    """A second window sharing the store admits the same chunks as b, a, c: c's orbit is now a
    mean over both orderings, and c's exact KV behind (b, a) is stored. Reordering the first
    window to b, a, c serves that exact KV, not the mean."""
    w = make()
    a, b, c = three(w)
    other = KameraWindow(w.backend, config=w.config, store=w.store)
    other.push(w.chunk(b), label="b")
    other.push(w.chunk(a), label="a")
    other.push(w.chunk(c), label="c")
    w.reorder([b, a, c])
    assert w.state_of(c) == other.state_of(other.refs[2]) and w.stats.last.forwards == 0
    assert_exact(w)


def test_slide_only_rotates_survivors_and_runs_no_forward(make: Make) -> None:
    w = make()
    a, b, c = three(w)
    states = [w.state_of(b), w.state_of(c)]
    gone = w.slide()
    assert gone == [a] and w.refs == [b, c]
    assert w.stats.last.forwards == 0 and w.stats.last.tokens_reused > 0
    assert a in w.evicted
    assert [w.state_of(b), w.state_of(c)] == states  # survivors keep what they absorbed from a
    oracle = StateOracle(w.backend)
    for ref in (a, b, c):
        oracle.know(w.chunk(ref))
    assert max(error for error, _ in oracle.errors(w).values()) <= EXACT  # and are what they say


def test_a_re_prefill_from_the_first_slot_forms_its_canonical_in_the_same_forward(make: Make) -> None:
    """An exact slide: the new first chunk is served as its canonical, which the store lacks (it
    was only ever formed over a left context), and the next is re-formed over it: one forward
    computes both, as the plan says beforehand; the canonical stored is the chunk's own."""
    w = make(survivors="removal")
    three(w)
    w.push("a green box", label="d")
    planned = w.plan("slide", 1)
    assert sum(edit.forwards for edit in planned.edits) == 1, planned
    w.slide(1)
    assert w.stats.last.forwards == 1 and w.stats.last.canonicals_formed == 1, w.last_plan
    assert_exact(w)
    first = w.refs[0]
    stored = w.store.get_canonical(w.chunk(first).key)
    alone = KameraWindow(w.backend, config=WindowConfig.exact())  # a store of its own
    alone.push(w.chunk(first))  # first in its window: its canonical, from a forward of its own
    own = alone.store.get_canonical(w.chunk(first).key)
    assert stored is not None and own is not None and stored is not own
    assert torch.allclose(stored.keys, own.keys, atol=1e-5)
    assert torch.allclose(stored.values, own.values, atol=1e-5)


def test_recall_reuses_its_stored_patch_and_the_second_recall_runs_no_forward(make: Make) -> None:
    w = make()
    a, _, c = three(w)
    w.evict(c)
    w.recall(c)  # same place, same antecedents: its stored patch, exact
    assert w.stats.last.forwards == 0
    assert_exact(w)
    w.slide(2)
    w.recall(a)
    first = w.stats.last
    w.evict(a)
    w.recall(a)
    assert w.stats.last.forwards == 0 and w.stats.last.vision_encodes == 0
    assert first.vision_encodes == 0


def test_recall_before_in_window_chunks_cascades_patches_in_order(make: Make) -> None:
    w = make()
    a, b, c = three(w)
    w.evict(a)
    plan = w.plan("recall", a, at=0)
    kinds = [(e.label, e.kind) for e in plan.edits]
    assert ("a", "admit") in kinds
    w.recall(a, at=0)
    assert w.refs == [a, b, c]
    assert_exact(w)  # b and c still encode a (they never lost it): exact again


def test_recall_at_front_with_current_context_and_cascade_is_exact(make: Make) -> None:
    w = make(recall_context="current", orbit=False)  # exact per-ordering patches only
    a, b, c = three(w)
    w.slide()
    d = w.push(images(1, seed=22)[0], label="d")
    w.recall(a, at=1)  # between b and c: c and d are re-patched in order
    assert w.refs == [b, a, c, d]
    assert_exact(w)


def test_probe_without_leaves_the_window_unchanged(make: Make) -> None:
    w = make()
    _, b, _ = three(w)
    before = [(r, w.patch_of(r)) for r in w.refs], sorted(w.graph.edges)
    probe = w.probe_without(b, "What rolled?")
    after = [(r, w.patch_of(r)) for r in w.refs], sorted(w.graph.edges)
    assert before == after
    assert probe.kl >= 0 and probe.cost.forwards > 0 and probe.cost.tokens_prefilled < 200
    assert probe.disposable == (probe.kl < w.config.probe_threshold)
    assert_exact(w)


def test_a_probe_the_store_cannot_serve_answers_as_the_window_without_the_chunk(make: Make) -> None:
    """Nothing stored for the reduced contexts: the chunks after the one switched off are formed
    over what is left, in one forward, so the answer is the model's own over the window without
    it; they are stored, so evicting it right after runs no forward for them."""
    w = make(survivors="removal")
    a, b, c = three(w)
    d = w.push("a second sentence after the picture", label="d")
    w.ask("What rolled?", decode=DecodeConfig(max_new_tokens=2))
    probe = w.probe_without(b, "What rolled?", max_new_tokens=2)
    without = [w.chunk(ref) for ref in (a, c, d)]
    truth = w.backend.reference_prefill(
        without, w.encoder.query_ids("What rolled?"), anchor=w.encoder.anchor()
    )
    assert next_token_kl(truth.logits, probe.without_chunk.first_logits) < 1e-9
    assert probe.cost.patches_formed == 2 and probe.cost.canonicals_formed == 0
    decodes = len(probe.without_chunk.tokens) + (probe.without_chunk.finish_reason == "eos")
    assert probe.cost.forwards == 1 + decodes  # one forward for c and d, then the decode
    assert_exact(w)  # the window as it was: its next answer too
    w.evict(b)
    assert w.stats.last.forwards == 0 and w.stats.last.patches_applied == 2
    assert_exact(w)


def test_fork_shares_the_store_but_not_the_edits(make: Make) -> None:
    w = make()
    a, b, c = three(w)
    branch = w.fork()
    branch.slide()
    branch.push("another text", label="d")
    assert w.refs == [a, b, c] and [r.label for r in branch.refs] == ["b", "c", "d"]
    assert_exact(w)
    assert branch.store is w.store


def test_lazy_patches_are_formed_at_the_next_read(make: Make) -> None:
    w = make(patch_mode="lazy")
    three(w)
    assert w.stats.by_op["push"].patches_formed == 0
    assert_exact(w)


def test_blind_reuse_is_measurably_worse(make: Make) -> None:
    w = make(patch_mode="none")
    three(w)
    assert answer_kl(w) > 1e-6


def test_capacity_slides_the_window_by_policy(make: Make) -> None:
    w = make(capacity_chunks=2)
    a, b, c = three(w)
    assert w.refs == [b, c] and w.evicted == [a]
    lru = make(capacity_chunks=2, eviction="lru")
    x, *_ = three(lru)
    assert lru.evicted == [x]


def test_bad_input_gets_named_errors_and_changes_nothing(make: Make) -> None:
    w = make()
    a, b, c = three(w)
    other = make()
    (foreign, *_) = three(other)
    state = (w.refs, sorted(w.graph.edges), w.store.stats().puts)
    with pytest.raises(UnknownChunkError, match="another window"):
        w.evict(foreign)
    with pytest.raises(DuplicateChunkError, match="twice"):
        w.reorder([a, a, c])
    with pytest.raises(UnknownChunkError, match="missing"):
        w.reorder([a, b])
    with pytest.raises(ChunkInWindowError, match="already in the window"):
        w.recall(a)
    with pytest.raises(UnreadableInputError, match="cannot push"):
        w.push(3.5)  # type: ignore[arg-type]
    with pytest.raises(ContextOverflowError, match="positions"):
        w.ask("x" * 10, decode=DecodeConfig(max_new_tokens=10**6))
    assert state == (w.refs, sorted(w.graph.edges), w.store.stats().puts)
    with pytest.raises(CapacityError, match="never fit"):
        make(capacity_tokens=3).push(images(1)[0])
    with pytest.raises(ValueError, match="capacity_chunks"):
        WindowConfig(drift_budget=None, capacity_chunks=0)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        WindowConfig(drift_budget=None, eviction="random")


def test_a_probe_after_the_same_ask_is_a_single_decode_and_kv_costs_are_recorded(make: Make) -> None:
    w = make(patch_mode="lazy")
    w.push(images(1, seed=41)[0])  # content no other test stored patches for
    b = w.push("a sentence only this test pushes")
    w.push(images(1, seed=42)[0])
    w.kv()
    assert w.stats.ops["kv"] == 1 and w.stats.by_op["kv"].patches_formed == 2  # lazy patches, counted
    w.ask("What rolled?", decode=DecodeConfig(max_new_tokens=3))
    w.probe_without(b, "What rolled?", max_new_tokens=3)  # forms the canonicals it switches to
    w.ask("What rolled?", decode=DecodeConfig(max_new_tokens=3))
    probe = w.probe_without(b, "What rolled?", max_new_tokens=3)
    without = probe.without_chunk  # only its decode runs: query prefill + one forward per later token
    assert probe.cost.forwards == len(without.tokens) + (without.finish_reason == "eos")
    assert probe.with_chunk.tokens == w.ask("What rolled?", decode=DecodeConfig(max_new_tokens=3)).tokens


def test_probe_driven_eviction_ranks_with_canonical_views_in_decodes(make: Make) -> None:
    """Scoring every chunk serves each switched-off view from canonicals (each formed once, for
    all the probes), not by re-prefilling the rest once per chunk: one decode forward a probe,
    one forward a missing canonical, and the pushed chunk's own formation."""
    w = make(capacity_chunks=3, eviction="disposable")
    three(w)
    w.ask("What rolled?", decode=DecodeConfig(max_new_tokens=1))
    w.push("one more line", label="d")
    last = w.stats.last
    assert last.probes == 3 and last.patches_formed == 1  # the probes formed no state of their own
    assert last.forwards == last.probes + last.canonicals_formed + 1


def test_probe_driven_eviction_drops_the_chunk_the_last_query_leans_on_least(make: Make) -> None:
    w = make(capacity_chunks=3, eviction="disposable")
    refs = three(w)
    w.ask("What rolled?", decode=DecodeConfig(max_new_tokens=1))
    scores = {ref: w.probe_kl(ref, "What rolled?") for ref in refs}
    w.push("one more line", label="d")
    assert w.evicted == [min(scores, key=scores.__getitem__)]


def test_plans_predict_the_forwards_ops_run_and_runs_share_one_forward(make: Make) -> None:
    w = make(orbit=False)
    refs = [
        w.push(text) for text in ("plan one alpha", "plan two beta", "plan three gamma", "plan four delta")
    ]
    new = [refs[0], refs[3], refs[1], refs[2]]
    plan = w.plan("reorder", new)
    assert plan.count("form_patch") == 3 and plan.forwards == 1  # one forward over the moved run
    w.reorder(new)
    assert w.stats.last.forwards == plan.forwards and w.stats.last.patches_formed == 3
    assert_exact(w)
    w.evict(refs[0])
    plan = w.plan("recall", refs[0], at=0)
    w.recall(refs[0], at=0)
    assert w.stats.last.forwards == plan.forwards


def test_a_chunk_left_alone_by_an_op_still_never_encodes_a_chunk_to_its_right(make: Make) -> None:
    """Found by the property test: recall to the end put an evicted antecedent of a survivor to
    that survivor's right; 'its left context did not change' must not keep that patch."""
    w = make()
    a = w.push("causal red")
    w.push("causal red")  # same content as a
    c = w.push("causal green ball")
    w.evict(a)
    w.recall(a)  # at the end: c's old patch encodes a, now to its right
    order = {ref: i for i, ref in enumerate(w.refs)}
    for source, target in w.graph.edges:
        if source in order and target in order:
            assert order[source] < order[target]
    assert w.state_of(c).kind != "canonical"  # it keeps what it encodes


def test_extend_admits_several_chunks_with_one_forward_and_matches_reprefill(make: Make) -> None:
    w = make()
    w.push("the window starts with this line", label="first")
    pics = images(2, seed=51)
    plan = w.plan("extend", [pics[0], "a caption in between", pics[1]], labels=["p", "t", "q"])
    assert plan.forwards == 1 and plan.count("form_patch") == 3  # one forward for all three
    refs = w.extend([pics[0], "a caption in between", pics[1]], labels=["p", "t", "q"])
    assert [r.label for r in refs] == ["p", "t", "q"] and w.refs[1:] == refs
    assert w.stats.last.forwards == 1 and w.stats.ops["extend"] == 1
    assert w.stats.last.tokens_prefilled == sum(w.chunk(r).num_tokens for r in refs)
    assert_exact(w)


def test_extend_over_capacity_makes_room_for_all_and_rejects_what_never_fits(make: Make) -> None:
    w = make(capacity_chunks=3)
    a, b, c = three(w)
    d, e = w.extend(["line d", "line e"])
    assert w.refs == [c, d, e] and w.evicted == [a, b]
    state = (w.refs, w.store.stats().puts)
    with pytest.raises(CapacityError, match="never fit"):
        w.extend(["one", "two", "three", "four"])
    with pytest.raises(WindowError, match="labels"):
        w.extend(["one", "two"], labels=["only one"])
    with pytest.raises(WindowError, match="at least one"):
        w.extend([])
    assert state == (w.refs, w.store.stats().puts)


def test_replace_takes_the_slot_and_survivors_keep_what_they_absorbed(make: Make) -> None:
    w = make()
    a, b, c = three(w)
    kept = w.state_of(c)
    caption = w.replace(b, "a short caption", label="b'")
    assert w.refs == [a, caption, c] and b in w.evicted
    assert w.stats.last.forwards == 1 and w.stats.last.tokens_prefilled == w.chunk(caption).num_tokens
    assert w.state_of(c) == kept  # c still encodes b (survivors="keep"): rotated, not re-formed
    oracle = StateOracle(w.backend)
    for ref in (a, b, c, caption):
        oracle.know(w.chunk(ref))
    assert max(error for error, _ in oracle.errors(w).values()) <= EXACT  # each chunk is what it says
    back = w.replace(caption, w.chunk(b))  # the same content again: a new ref, its stored KV
    assert w.refs == [a, back, c] and back.key == b.key and back != b
    assert w.stats.last.forwards == 0  # b's KV over a is stored: applied, no forward


def test_replace_with_appended_chunks_is_one_forward_that_each_chunk_checks_against(make: Make) -> None:
    """A browsing agent's step: the oldest screenshot replaced by its caption, a line and a new
    screenshot appended. One forward forms the caption (over a only: c sits between) and the
    appended chunks (over everything); each chunk's KV is what its state says it encodes."""
    w = make()
    a, b, c = three(w)
    pic = images(1, seed=61)[0]
    plan = w.plan(
        "replace", b, "a short caption", append=["clicked next", pic], append_labels=["line", "shot"]
    )
    assert plan.forwards == 1 and plan.count("form_patch") == 3
    caption = w.replace(b, "a short caption", append=["clicked next", pic], append_labels=["line", "shot"])
    line, shot = w.refs[-2:]
    assert w.refs == [a, caption, c, line, shot] and (line.label, shot.label) == ("line", "shot")
    assert w.stats.last.forwards == 1 and b in w.evicted
    assert w.stats.last.tokens_prefilled == sum(w.chunk(r).num_tokens for r in (caption, line, shot))
    oracle = StateOracle(w.backend)
    for ref in (a, b, c, caption, line, shot):
        oracle.know(w.chunk(ref))
    assert max(error for error, _ in oracle.errors(w).values()) <= EXACT


def test_a_gapped_forward_without_a_kept_cache_matches_reprefill() -> None:
    """An engine that runs gaps but cannot extend caches: the forward's context is assembled
    afresh (anchor, the chunks left of the first member, the chunks between members)."""
    backend = CountingBackend(backend_named("tiny_torch"), extend=False)
    w = KameraWindow(backend, config=WindowConfig(drift_budget=None, rank="full"))
    b = [w.push(text) for text in ("first line here", "second line", "third line")][1]
    w.replace(b, "a caption", append=["one more line"])
    assert w.stats.last.forwards == 1 and backend.calls["crop"] == 0
    oracle = StateOracle(w.backend)
    for ref in [*w.refs, b]:
        oracle.know(w.chunk(ref))
    assert max(error for error, _ in oracle.errors(w).values()) <= EXACT


def test_replace_with_appended_chunks_answers_like_replace_then_extend(make: Make) -> None:
    """Same KV either way (one forward or two): the answers agree; under the exact settings
    both equal a re-prefill."""
    answers = []
    for fused in (True, False):
        w = make(survivors="removal")
        b = three(w)[1]
        if fused:
            w.replace(b, "a short caption", append=["clicked next"])
        else:
            w.replace(b, "a short caption")
            w.extend(["clicked next"])
        assert_exact(w)
        answers.append(w.ask("What is it?", decode=DecodeConfig(max_new_tokens=2)).first_logits)
    assert float((answers[0] - answers[1]).abs().max()) < 1e-4


def test_replace_under_the_exact_settings_re_forms_the_chunks_to_its_right(make: Make) -> None:
    w = make(survivors="removal")
    a, b, c = three(w)
    caption = w.replace(b, "a short caption")
    assert w.refs == [a, caption, c] and w.stats.last.forwards == 1  # caption and c: one forward
    assert_exact(w)
    with pytest.raises(UnknownChunkError):
        w.replace(b, "not in the window any more")


def test_a_chunk_taking_a_same_content_holders_kv_records_what_that_kv_encodes() -> None:
    """Repeated content re-read by an agent (the property tests' shrunk case): after a slide
    each "red" takes the KV the "red" before it held in its slot, so one op rewrites the edges
    of a chunk whose old KV the next chunk takes. The taker's edges record the states the old KV
    encodes, not the states its sources hold after the op, and every KV is what its state says."""
    config = WindowConfig(rank=2, capacity_chunks=5, reorder="revert", max_evicted=3, drift_budget=None)
    w = KameraWindow(backend_named("tiny_torch"), config=config)
    texts = ["green ball", "red", "green ball", "red", "red", "green ball", "red", "red", "red"]
    texts += ["red", "green ball", "red"]
    for text in texts:
        w.push(text, label=text)
    branch = w.fork()
    branch.slide(1)
    oracle = StateOracle(w.backend)
    for window in (w, branch):
        for ref in [*window.refs, *window.evicted]:
            oracle.know(window.chunk(ref))
        for _, target, recorded in window.graph.edges(data="state"):
            state = window.state_of(target)
            assert recorded in {s.digest for s in state.context.states()}, (target, recorded)
        assert max(error for error, _ in oracle.errors(window).values()) <= 1e-4
