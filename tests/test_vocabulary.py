"""One word, one meaning: "keep" and "budget" name one thing each in the package's identifiers.

"keep" is what a chunk does with what it absorbed when the chunks to its left change (its state
still encodes it: ``survivors="keep"``, an engine's kept states); "budget" is the drift budget ε.
Storing formed KV is *store*, an engine holding its cache between forwards *retain*, sparing an
entry from eviction *pin*, a cap on bytes or pixels a *limit* (docs/concepts.md's glossary). A
name that holds either word in another sense reads as the wrong thing, so every identifier that
contains one must be below, with the meaning it has. Old names kept one release for their users
(deprecated aliases) are listed as such.
"""

from __future__ import annotations

import io
import re
import tokenize
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kamera_agent"

ALLOWED: dict[str, str] = {
    # keep: a chunk keeps what it absorbed; an engine serves such a kept state within the budget
    "KeptLoad": "a load an engine left in a kept state",
    "KeptSlots": "the radix tree's slots that hold kept loads",
    "KeptBudget": "the drift budget kept states are served within",
    "kept_loads": "the kept loads an engine holds",
    "kept_slots": "the radix tree's slots that hold kept loads",
    "kept_refused": "a kept state refused: nothing vouched for it within the budget",
    "kept_tokens": "tokens served in kept states",
    "tokens_kept": "tokens offered in kept states",
    "held_kept": "tokens of the engine's own hit in kept states",
    "KeptSlide": "a slide whose survivors keep what the chunk that left gave them (a benchmark's episode)",
    "kept_slide": "builds a KeptSlide",
    "kept_kv": "a KeptSlide's survivors' KV as they kept it",
    # budget: the drift budget ε
    "budget": "a drift budget (or a calibration's default ε)",
    "BUDGETS": "the ε a calibration is judged at",
    "DriftBudget": "the drift budget",
    "drift_budget": "the drift budget setting",
    "answer_budget": "the drift budget setting in answer units (the window's next-token KL)",
    "engine_budget": "the drift budget an engine serves under",
    "window_budget": "the drift budget a window runs with",
    "shared_budget": "the drift budget the windows on one store share",
    "vouch_budget": "the drift budget ε a calibration's plan-time bounds may serve kept states within",
    "pick_budget": "the calibration's choice of ε",
    "budgeted": "a window-suite row the drift budget decides (the defaults, or the budget at one ε)",
    "_budget_fix_tokens": "what fixing the drift budget's first chunk over ε costs",
    "_budget_is_valid": "the drift_budget setting's check",
    # deprecated aliases, one release: a store's byte caps are limits now
    "memory_budget": "deprecated: memory_limit",
    "disk_budget": "deprecated: disk_limit",
    # other libraries' words and plain English ("go on")
    "keep_going": "a decode loop's continue-or-stop callback",
    "KeepGoing": "a decode loop's continue-or-stop callback type",
    "keep_blank_values": "urllib.parse.parse_qs's argument",
}
"""Each allowed identifier → its meaning."""

ALLOWED_IN: dict[str, tuple[str, str]] = {
    "kept": ("serve/usage.py", "the usage field of prompt tokens served in kept states"),
}
"""A short word allowed in one module only: module (under kamera_agent/) and its meaning there."""

WORDS = re.compile(r"keep|kept|budget", re.IGNORECASE)


def identifiers() -> dict[tuple[str, str], int]:
    """Every (name, module) whose name holds one of the words, with a line it appears on."""
    found: dict[tuple[str, str], int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        source = path.read_text(encoding="utf-8")
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.NAME and WORDS.search(token.string):
                found.setdefault((token.string, module), token.start[0])
    return found


def test_keep_and_budget_name_one_thing_each() -> None:
    wrong = [
        f"kamera_agent/{module}:{line}: {name}"
        for (name, module), line in identifiers().items()
        if name not in ALLOWED and ALLOWED_IN.get(name, ("",))[0] != module
    ]
    assert not wrong, (
        "identifiers using 'keep' or 'budget' in another sense (store / retain / pin / limit, "
        "see docs/concepts.md's glossary), or new ones to list in ALLOWED with their meaning:\n"
        + "\n".join(wrong)
    )


def test_every_allowed_name_is_still_used() -> None:
    """An allowed name nobody uses any more leaves the list, so the list stays short and true."""
    names = {name for name, _ in identifiers()}
    stale = sorted((set(ALLOWED) | set(ALLOWED_IN)) - names)
    assert not stale, stale


@pytest.mark.parametrize(
    ("build", "new"),
    [
        (lambda config: config(memory_budget=1 << 20).memory_limit, 1 << 20),
        (lambda config: config(disk_dir="d", disk_budget=1 << 20).disk_limit, 1 << 20),
        (lambda config: config(evicted_pixels="keep").evicted_pixels, "retain"),
    ],
    ids=["memory_budget", "disk_budget", "evicted_pixels-keep"],
)
def test_a_settings_old_name_still_works_with_a_warning(build: object, new: object) -> None:
    from kamera_agent.config import WindowConfig

    with pytest.warns(DeprecationWarning, match="is now"):
        assert build(WindowConfig) == new  # type: ignore[operator]


def test_the_stores_old_names_still_work_with_a_warning() -> None:
    import kamera_agent
    from kamera_agent import errors
    from kamera_agent.store import ChunkStore

    with pytest.warns(DeprecationWarning, match="memory_budget is now memory_limit"):
        store = ChunkStore(fingerprint="f" * 64, memory_budget=1 << 20)
    with store, pytest.warns(DeprecationWarning, match="memory_budget is now memory_limit"):
        assert store.stats().memory_budget == 1 << 20
    for module in (kamera_agent, errors):
        with pytest.warns(DeprecationWarning, match="StoreBudgetError is now StoreLimitError"):
            assert module.StoreBudgetError is errors.StoreLimitError
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "StoreBudgetError" not in kamera_agent.__all__
