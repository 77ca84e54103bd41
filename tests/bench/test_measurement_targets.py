"""The targets a demo model is held to (issue 16) are computed from the fidelity run itself."""

from __future__ import annotations

from rich.progress import Progress

from kamera_agent.backends import TransformersBackend
from kamera_agent.bench.fidelity import CONTROL_ARMS, FidelityRun, run_fidelity
from kamera_agent.bench.results import measurement_targets
from kamera_agent.demo.model import load_demo_model
from kamera_agent.demo.task import make_items


def test_every_measurement_target_is_reported_and_judged_from_the_run() -> None:
    assert all(t.met is None and t.measured == "not run" for t in measurement_targets(None))
    model, tokenizer, image_processor = load_demo_model()
    backend = TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)
    arms = ("blind", "cacheblend", "cacheblend-global-15", "epic", "cacheblend-bytes-16", "rank-2", "rank-16")
    run = FidelityRun(model="demo", seed=424_242, items_requested=6, arms=(*arms, "orbit-16"))
    control = make_items(3, 424_243, "colour", sparse=True)
    with Progress(disable=True) as progress:
        run_fidelity(backend, make_items(6, 424_242), run, progress, control)
    found = {t.claim.split(":")[0]: t for t in measurement_targets(run)}
    assert len(found) == 6
    assert all(t.met is not None for t in found.values())  # every target judged, none "not run"
    assert "stores 28% of a page's KV" in found["graded knee"].measured  # 16·(100 + 128) / (100·128)
    assert run.control_items_done == 3
    assert [arm for arm, _, _ in run.control_figures()] == ["reprefill", *CONTROL_ARMS]
    deficit = run.evaluation.deficit
    assert deficit.chunks == 12 and deficit.relative[0] < 1e-4  # layer 0 sees no context
    assert len(deficit.order_change) == 12 * 2  # every page under two other legend orders
