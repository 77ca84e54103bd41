"""The demo task is deterministic, well-posed, and rendered as the model will see it."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from kamera_agent.demo.task import (
    BLANK,
    COLOURS,
    DENSE_GLYPHS,
    GLYPHS,
    LEGEND_FRAMES,
    PAGE_CELLS,
    PAGES_PER_ITEM,
    READOUT_COLOUR,
    SPARSE_GLYPHS,
    make_item,
    make_items,
    render_legend,
    render_page,
)


def test_items_are_deterministic_by_seed_and_split_by_seed() -> None:
    assert make_items(20, seed=5) == make_items(20, seed=5)
    assert make_items(20, seed=5) != make_items(20, seed=6)
    assert make_items(5, seed=5, sparse=True) != make_items(5, seed=5)


@pytest.mark.parametrize("sparse", [False, True])
def test_every_item_is_well_posed(sparse: bool) -> None:
    kinds, answers = set(), Counter()
    for item in make_items(300, seed=1, sparse=sparse):
        kinds.add(item.kind)
        meaning = item.meaning
        assert len(item.legend) == LEGEND_FRAMES and len(meaning) == len(COLOURS) == 16  # 16 meanings
        assert sorted(meaning.values()) == sorted(COLOURS)  # every colour meant once: chance is 1/16
        assert len(item.pages) == PAGES_PER_ITEM and all(len(p) == PAGE_CELLS for p in item.pages)
        shown = item.glyph_counts
        assert set(shown) == set(meaning) - {item.absent}  # every glyph but one is on the pages
        if sparse:
            assert set(shown.values()) == {1}
            assert sorted(sum(c != BLANK for c in p) for p in item.pages) == [7, SPARSE_GLYPHS]
        else:  # 8 or 9 of each: no meaning is rare but the absent one
            assert set(shown.values()) <= {8, 9}
            assert all(sum(c != BLANK for c in p) == DENSE_GLYPHS for p in item.pages)
        assert item.sparse == sparse
        readout = next(glyph for glyph, colour in meaning.items() if colour == READOUT_COLOUR)
        assert item.answer == (meaning[item.absent] if item.kind == "colour" else readout)
        assert item.multi_hop == (item.kind == "colour")
        answers[item.answer] += item.kind == "colour"
    assert kinds == {"colour", "glyph"}
    assert len(answers) >= 15  # the binding answer ranges over the meanings


def test_answers_differ_in_their_first_token() -> None:
    assert len({name[0] for name in COLOURS}) == len(COLOURS)
    assert len(set(GLYPHS.values())) == len(GLYPHS) == 16
    assert set(GLYPHS).isdisjoint(name[0] for name in COLOURS)  # a readout answer is no colour's start


def test_frames_put_one_glyph_in_each_merged_token() -> None:
    entries = (("F", "red"), ("A", "blue"), ("P", "green"), ("G", "cyan"))
    legend = np.asarray(render_legend(entries))
    assert legend.shape == (56, 56, 3)
    cells = ["F", "A", "P", "G", BLANK, BLANK] * (PAGE_CELLS // 6)
    page = np.asarray(render_page(cells))
    assert page.shape == (224, 336, 3)  # 8 x 12 merged tokens
    # the same glyph in the same 28-pixel token: the legend's in its colour, the page's in white
    ink_legend = legend[:28, :28].max(axis=-1) > 0
    ink_page = page[:28, :28].max(axis=-1) > 0
    assert np.array_equal(ink_legend, ink_page)
    assert {tuple(px) for px in legend[:28, :28][ink_legend]} == {COLOURS["red"]}
    assert {tuple(px) for px in page[:28, :28][ink_page]} == {(255, 255, 255)}
    assert not page[:28, 4 * 28 : 6 * 28].any()  # filler cells are empty
    # every glyph is a different pattern, and every glyph shows ink in each of its four cells
    patterns = {np.asarray(render_page([g] * PAGE_CELLS))[:28, :28].tobytes() for g in GLYPHS}
    assert len(patterns) == 16
    one = np.asarray(render_page(["A"] * PAGE_CELLS))[:28, :28].max(axis=-1)
    assert all(one[r : r + 14, c : c + 14].any() for r in (0, 14) for c in (0, 14))


def test_frames_refuse_the_wrong_number_of_glyphs() -> None:
    with pytest.raises(ValueError, match="holds 4 entries"):
        render_legend((("A", "red"),))
    with pytest.raises(ValueError, match="holds 96 cells"):
        render_page(["A"] * 15)


def test_the_training_curriculum_can_show_fewer_glyphs_and_refuses_impossible_pages() -> None:
    rng = random.Random(2)
    item = make_item(rng, "colour", glyphs_shown=30)
    assert sum(item.glyph_counts.values()) == 30 and set(item.glyph_counts.values()) == {2}
    for shown in (14, 2 * PAGE_CELLS + 1):
        with pytest.raises(ValueError, match="pages show 15 to 192 glyphs"):
            make_item(rng, glyphs_shown=shown)
