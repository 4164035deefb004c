"""The linear tiling check agrees with brute-force counting on random boxes."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tsckpt.errors import PlanError
from tsckpt.format.grid import aligned_chunk_shape, check_tiling


def _exact_cover(shape, boxes):
    count = np.zeros(shape, dtype=int)
    for o, s in boxes:
        if any(oi < 0 or oi + si > n for oi, si, n in zip(o, s, shape)):
            return False
        count[tuple(slice(a, a + b) for a, b in zip(o, s))] += 1
    return bool((count == 1).all())


def _accepts(shape, boxes):
    try:
        check_tiling("t", shape, boxes)
    except PlanError:
        return False
    return True


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
    assert _accepts(shape, boxes) == (bool(nonempty) and _exact_cover(shape, nonempty))


def test_array_input_and_messages():
    rows = np.array([[[r * 3, 0], [3, 4]] for r in range(4)])  # rows 0..12 of a (12, 4) tensor
    check_tiling("w", (12, 4), rows)
    with pytest.raises(PlanError, match=r"'w': regions at \[3, 0\] and \[3, 0\] overlap"):
        check_tiling("w", (12, 4), np.concatenate([rows, rows[1:2]]))
    with pytest.raises(PlanError, match=r"exactly once \(no region holds the element at \[9, 0\]\)"):
        check_tiling("w", (12, 4), rows[:3])


@st.composite
def slabs(draw):
    """Slabs of one dimension, as DCP's splits make them, sometimes with one edge moved by one element."""
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    d = draw(st.integers(0, len(shape) - 1))
    cuts = sorted(set(draw(st.lists(st.integers(0, shape[d]), max_size=4))) | {0, shape[d]})
    boxes = [[[c if k == d else 0 for k in range(len(shape))], [e - c if k == d else n for k, n in enumerate(shape)]]
             for c, e in zip(cuts, cuts[1:])] or [[[0] * len(shape), list(shape)]]
    if draw(st.booleans()):
        box, k, by = draw(st.sampled_from(boxes)), draw(st.integers(0, len(shape) - 1)), draw(st.sampled_from([-1, 1]))
        box[draw(st.integers(0, 1))][k] += by
    return shape, draw(st.permutations(boxes))


@settings(max_examples=400, deadline=None)
@given(slabs(), st.booleans())
def test_few_boxes_decided_in_python_match_brute_force(case, as_array):
    # Up to FEW_BOXES boxes, valid slabs are accepted without numpy: that shortcut must never accept a bad plan,
    # and the chunk grid it derives must be the gcd of every interior edge.
    shape, boxes = case
    given_boxes = np.asarray(boxes, dtype=np.int64).reshape(len(boxes), 2, len(shape)) if as_array else boxes
    nonempty = [b for b in boxes if all(s > 0 for s in b[1])]
    accepted = _accepts(shape, given_boxes)
    assert accepted == (bool(nonempty) and _exact_cover(shape, nonempty) or (not nonempty and 0 in shape))
    if accepted:
        expected = []
        for d, n in enumerate(shape):
            gcd = 0
            for o, s in nonempty:
                for edge in (o[d], o[d] + s[d]):
                    gcd = math.gcd(gcd, edge) if 0 < edge < n else gcd
            expected.append(gcd or max(n, 1))
        assert aligned_chunk_shape(shape, given_boxes) == tuple(expected)
