"""The demo task is deterministic, well-posed, and rendered as the model will see it."""

from __future__ import annotations

import numpy as np
import pytest

from kamera_agent.demo.task import (
    COLOURS,
    GLYPHS,
    GLYPHS_PER_PAGE,
    LEGEND_FRAMES,
    PAGES_PER_ITEM,
    make_items,
    render_legend,
    render_page,
)


def test_items_are_deterministic_by_seed_and_split_by_seed() -> None:
    assert make_items(20, seed=5) == make_items(20, seed=5)
    assert make_items(20, seed=5) != make_items(20, seed=6)


def test_every_item_is_well_posed() -> None:
    kinds = set()
    for item in make_items(300, seed=1):
        kinds.add(item.kind)
        meaning = item.meaning
        assert len(item.legend) == LEGEND_FRAMES and len(meaning) == len(COLOURS)  # 8 distinct glyphs
        assert sorted(meaning.values()) == sorted(COLOURS)  # every colour meant once: chance is 1/8
        assert len(item.pages) == PAGES_PER_ITEM and all(len(p) == GLYPHS_PER_PAGE for p in item.pages)
        counts = item.glyph_counts.most_common()
        assert all(glyph in meaning for glyph, _ in counts)
        (top, votes), runner_up = counts[0], counts[1][1]
        assert votes >= runner_up + 3  # a clear majority
        assert item.answer == (meaning[top] if item.kind == "majority" else top)
        assert item.multi_hop == (item.kind == "majority")
    assert kinds == {"majority", "glyph"}


def test_answers_differ_in_their_first_token() -> None:
    assert len({name[0] for name in COLOURS}) == len(COLOURS)
    assert len(set(GLYPHS.values())) == len(GLYPHS) == 16


def test_frames_put_one_glyph_in_each_merged_token() -> None:
    entries = (("f", "red"), ("a", "blue"), ("p", "green"), ("g", "cyan"))
    legend = np.asarray(render_legend(entries))
    assert legend.shape == (56, 56, 3)
    page = np.asarray(render_page(["f", "a", "p", "g"] * 4))
    assert page.shape == (112, 112, 3)
    # the same glyph in the same 28-pixel token: the legend's in its colour, the page's in white
    ink_legend = legend[:28, :28].max(axis=-1) > 0
    ink_page = page[:28, :28].max(axis=-1) > 0
    assert np.array_equal(ink_legend, ink_page)
    assert {tuple(px) for px in legend[:28, :28][ink_legend]} == {COLOURS["red"]}
    assert {tuple(px) for px in page[:28, :28][ink_page]} == {(255, 255, 255)}
    # every glyph is a different pattern, and every glyph shows ink in each of its four cells
    patterns = {np.asarray(render_page([g] * 16))[:28, :28].tobytes() for g in GLYPHS}
    assert len(patterns) == 16
    blank = np.asarray(render_page(["a"] * 16))[:28, :28].max(axis=-1)
    assert all(blank[r : r + 14, c : c + 14].any() for r in (0, 14) for c in (0, 14))


def test_frames_refuse_the_wrong_number_of_glyphs() -> None:
    with pytest.raises(ValueError, match="holds 4 entries"):
        render_legend((("a", "red"),))
    with pytest.raises(ValueError, match="holds 16 glyphs"):
        render_page(["a"] * 15)
