"""The targets a demo model is held to (issue 16) are computed from the fidelity run itself."""

from __future__ import annotations

from rich.progress import Progress

from kamera_agent.backends import TransformersBackend
from kamera_agent.bench.fidelity import FidelityRun, run_fidelity
from kamera_agent.bench.results import measurement_targets
from kamera_agent.demo.model import load_demo_model
from kamera_agent.demo.task import make_items


def test_every_measurement_target_is_reported_and_judged_from_the_run() -> None:
    assert all(t.met is None and t.measured == "not run" for t in measurement_targets(None))
    model, tokenizer, image_processor = load_demo_model()
    backend = TransformersBackend(model, tokenizer=tokenizer, image_processor=image_processor)
    arms = ("blind", "rank-2", "rank-16", "orbit-16")
    run = FidelityRun(model="demo", seed=424_242, items_requested=8, arms=arms)
    with Progress(disable=True) as progress:
        run_fidelity(backend, make_items(8, 424_242), run, progress)
    found = {t.claim.split(":")[0]: t for t in measurement_targets(run)}
    assert len(found) == 6
    assert found["re-prefill >= 95 % on binding"].met is True
    knee = found["graded knee"]
    assert knee.met is False and "stores 106%" in knee.measured  # this demo model: rank 16 is full rank
    assert found["sparse-binding control"].met is None  # the task has none yet
    assert (
        run.evaluation.deficit.chunks == 16 and run.evaluation.deficit.relative[0] < 1e-4
    )  # layer 0 sees no context
