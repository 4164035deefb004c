"""The linear tiling check agrees with brute-force counting on random boxes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tsckpt.errors import PlanError
from tsckpt.format.grid import check_tiling


def _exact_cover(shape, boxes):
    count = np.zeros(shape, dtype=int)
    for o, s in boxes:
        if any(oi < 0 or oi + si > n for oi, si, n in zip(o, s, shape)):
            return False
        count[tuple(slice(a, a + b) for a, b in zip(o, s))] += 1
    return bool((count == 1).all())


@st.composite
def shapes_and_boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    coord = [st.integers(0, n) for n in shape]
    boxes = draw(st.lists(st.tuples(st.tuples(*coord), st.tuples(*coord)), min_size=1, max_size=6))
    return shape, boxes


@settings(max_examples=400, deadline=None)
@given(shapes_and_boxes())
def test_matches_brute_force(case):
    shape, boxes = case
    nonempty = [b for b in boxes if all(s > 0 for s in b[1])]
    try:
        check_tiling("t", shape, boxes)
        accepted = True
    except PlanError:
        accepted = False
    assert accepted == (bool(nonempty) and _exact_cover(shape, nonempty))


def test_array_input_and_messages():
    rows = np.array([[[r * 3, 0], [3, 4]] for r in range(4)])  # rows 0..12 of a (12, 4) tensor
    check_tiling("w", (12, 4), rows)
    with pytest.raises(PlanError, match=r"'w': regions at \[3, 0\] and \[3, 0\] overlap"):
        check_tiling("w", (12, 4), np.concatenate([rows, rows[1:2]]))
    with pytest.raises(PlanError, match=r"exactly once \(no region holds the element at \[9, 0\]\)"):
        check_tiling("w", (12, 4), rows[:3])
