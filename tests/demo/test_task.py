"""The demo task is deterministic, well-posed, and rendered as the model will see it."""

from __future__ import annotations

from collections import Counter

import numpy as np

from kamera_agent.demo.task import COLOURS, GLYPHS, LEGEND_PER_ITEM, make_items, render_legend, render_symbol


def test_items_are_deterministic_by_seed_and_split_by_seed() -> None:
    assert make_items(20, seed=5) == make_items(20, seed=5)
    assert make_items(20, seed=5) != make_items(20, seed=6)


def test_every_item_is_well_posed() -> None:
    for item in make_items(300, seed=1):
        meaning = item.meaning
        assert len(set(meaning)) == len(item.legend) == LEGEND_PER_ITEM  # distinct glyphs
        assert all(glyph in meaning for glyph in item.symbols)
        votes = Counter(meaning[g] for g in item.symbols)
        winner, count = votes.most_common(1)[0]
        assert count >= 3  # a strict majority of the five frames
        if item.kind == "majority":
            assert item.answer == winner
        elif item.kind == "colour":
            assert item.answer == meaning[item.symbols[item.k - 1]]
        else:
            assert item.answer == item.symbols[item.k - 1] and not item.multi_hop


def test_colour_answers_differ_in_their_first_token() -> None:
    assert len({name[0] for name in COLOURS}) == len(COLOURS)
    assert len(set(GLYPHS.values())) == len(GLYPHS) == 16


def test_frames_show_the_glyph_and_the_colour() -> None:
    legend = np.asarray(render_legend("f", "red"))
    assert legend.shape == (56, 56, 3)
    assert tuple(legend[40, 40]) == tuple(legend[5, 50]) == COLOURS["red"]  # the swatch quarters
    symbol = np.asarray(render_symbol("f"))
    assert np.array_equal(symbol[:28, :28], legend[:28, :28])  # the same glyph token in both frames
    assert tuple(symbol[40, 40]) == (128, 128, 128)
    assert not np.array_equal(np.asarray(render_symbol("g"))[:28, :28], symbol[:28, :28])
