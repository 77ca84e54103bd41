"""Ground truth for window tests: every chunk's KV against the engine's own full re-prefill."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kamera_agent.backends.base import DecodeConfig, Reference
from kamera_agent.core.identity import ChunkState
from kamera_agent.fidelity import Calibration, save_calibration
from kamera_agent.window import KameraWindow
from tests.kv_helpers import next_token_kl, rel_err


def reprefill(window: KameraWindow, query: str | None = None) -> Reference:
    """The engine's own forward over the window's full sequence (anchor, chunks, query)."""
    chunks = [window.chunk(ref) for ref in window.refs]
    query_ids = None if query is None else window.encoder.query_ids(query)
    return window.backend.reference_prefill(chunks, query_ids, anchor=window.encoder.anchor())


def chunk_errors(window: KameraWindow) -> dict[str, float]:
    """Worst per-layer relative error of each in-window chunk's KV against the re-prefill's, by label,
    as the next answer sees it (a read: lazily deferred patches are formed first)."""
    window.kv()
    truth = reprefill(window)
    errors = {}
    for ref, want in zip(window.refs, truth.kv[1:], strict=True):
        got = window.chunk_kv(ref)
        errors[ref.label] = max(
            rel_err(getattr(got, slot)[layer], getattr(want, slot)[layer])
            for layer in range(want.keys.shape[0])
            for slot in ("keys", "values")
        )
    return errors


def chunk_errors_in_order(window: KameraWindow) -> list[float]:
    """`chunk_errors` slot by slot (chunks of the same content share a label)."""
    window.kv()
    truth = reprefill(window)
    return [
        max(
            rel_err(getattr(window.chunk_kv(ref), slot)[layer], getattr(want, slot)[layer])
            for layer in range(want.keys.shape[0])
            for slot in ("keys", "values")
        )
        for ref, want in zip(window.refs, truth.kv[1:], strict=True)
    ]


def answer_kl(window: KameraWindow, query: str = "What is it?") -> float:
    """Next-token KL(re-prefill ‖ window) for ``query``."""
    reference = reprefill(window, query).logits
    return next_token_kl(reference, window.ask(query, decode=DecodeConfig(max_new_tokens=1)).first_logits)


def answer_gap(window: KameraWindow, query: str = "What is it?") -> tuple[float, float]:
    """Next-token KL(re-prefill ‖ window) and the largest next-token logit difference for ``query``."""
    reference = reprefill(window, query).logits
    got = window.ask(query, decode=DecodeConfig(max_new_tokens=1)).first_logits.to(reference.device)
    return next_token_kl(reference, got), float((got - reference).abs().max())


def calibrate_for_tests(fingerprint: str, directory: Path, **fields: Any) -> Calibration:
    """File a calibration for ``fingerprint`` in ``directory`` (point ``KAMERA_CALIBRATION_DIR``
    there): random test models have none, so a budgeted window on one would run exactly. The
    constants are the test's choice, not a fit: tests check that the budget is kept against the
    estimate and that what the estimate calls exact is, not the fit's calibration (the benchmark's)."""
    calibration = Calibration(
        fingerprint, **{"scale": 1.0, "inherit": 0.5, "audit_share": 0.5, "budget": 0.05, **fields}
    )
    save_calibration(calibration, directory)
    return calibration


def absorbed(state: ChunkState, digest: str) -> ChunkState | None:
    """The state ``digest`` among those ``state``'s KV encodes (its antecedents, theirs, and so on)."""
    for antecedent in state.antecedents():
        found = antecedent if antecedent.digest == digest else absorbed(antecedent, digest)
        if found is not None:
            return found
    return None


def right_to_left_edges(window: KameraWindow) -> list[tuple[object, object]]:
    """The in-window edges whose source stands right of their target, after checking each: it
    goes into a chunk that stood when a chunk it had absorbed came back to its right, and names
    the state that chunk had then, one the target's state was formed over and one that encodes
    nothing of the target (states never cycle). An orbit encodes a set, not a chain: its edges
    are counted unchecked."""
    order = {ref: i for i, ref in enumerate(window.refs)}
    found = []
    for source, target, recorded in window.graph.edges(data="state"):
        if source in order and target in order and order[source] > order[target]:
            held = window.state_of(target)
            if held.kind != "orbit":
                then = absorbed(held, recorded)
                assert then is not None, (source, target)
                assert absorbed(then, held.digest) is None, (source, target)
            found.append((source, target))
    return found


def budget_ops(texts: Sequence[str]) -> list[Callable[[KameraWindow], object]]:
    """Pushes, a slide, a push, a reversal, a middle eviction, a recall at the front, a slide of
    two: every op a drift budget may approximate in (``texts``: five)."""
    ops: list[Callable[[KameraWindow], object]] = [lambda w, t=t: w.push(t, label=t) for t in texts[:4]]
    ops += [lambda w: w.slide(1), lambda w: w.push(texts[4]), lambda w: w.reorder(list(reversed(w.refs)))]
    ops += [lambda w: w.evict(w.refs[1]), lambda w: w.recall(w.evicted[0], at=0), lambda w: w.slide(2)]
    return ops


def check_never_costlier(window: KameraWindow, op: Callable[[KameraWindow], object]) -> None:
    """Run ``op``: its prefilled tokens, its budget's audits apart, stay within re-prefilling from
    the first slot whose content changed (counted here from chunk keys)."""
    anchor = window.encoder.anchor().num_tokens
    before = [window.chunk(ref).key for ref in window.refs]
    op(window)
    after = [window.chunk(ref) for ref in window.refs]
    same = next(
        (k for k, (a, b) in enumerate(zip(before, after, strict=False)) if a != b.key),
        min(len(before), len(after)),
    )
    prefix = sum(chunk.num_tokens for chunk in after[same:]) + anchor
    cost = window.stats.last
    assert cost.tokens_prefilled - cost.audit_tokens <= prefix, (cost, window.last_plan)
