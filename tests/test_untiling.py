"""Untiling a block of inner chunks straight into place agrees with untiling it whole and slicing."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tsckpt
from tsckpt.format import shards
from tsckpt.format.untiling import linear_boxes, stored_block, untile_into


def _reference(values, inner, origin, lo, hi):
    """The block untiled into one array, then ``[lo, hi)`` of it: the obvious two-copy way."""
    ndim = len(inner)
    block = values.shape[:ndim]
    order = [k for d in range(ndim) for k in (d, ndim + d)]
    whole = values.transpose(order).reshape(tuple(b * i for b, i in zip(block, inner)))
    return whole[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, origin))]


@st.composite
def cases(draw):
    ndim = draw(st.integers(0, 3))
    inner = [draw(st.integers(1, 4)) for _ in range(ndim)]
    block = [draw(st.integers(1, 4)) for _ in range(ndim)]
    origin = [draw(st.integers(0, 9)) for _ in range(ndim)]
    lo, hi = [], []
    for o, b, i in zip(origin, block, inner):
        a = draw(st.integers(o, o + b * i))
        lo.append(a)
        hi.append(draw(st.integers(a, o + b * i)))
    # The destination may be larger than the box and start before it (a rank's tensor, the box one part).
    before = [draw(st.integers(0, 2)) for _ in range(ndim)]
    after = [draw(st.integers(0, 2)) for _ in range(ndim)]
    # Each inner chunk stored with 4 bytes after it, as with the crc32c codec: values are a strided view.
    padded = draw(st.booleans())
    return inner, block, origin, lo, hi, before, after, padded


@settings(max_examples=500, deadline=None)
@given(cases())
def test_matches_untiling_whole(case):
    inner, block, origin, lo, hi, before, after, padded = case
    count, raw = int(np.prod(block)), int(np.prod(inner))
    stored = np.arange(count * (raw + 2), dtype=np.int16).reshape(count, raw + 2)
    pieces = stored[:, :raw] if padded else np.ascontiguousarray(stored[:, :raw])
    values = pieces.reshape((*block, *inner))
    out_origin = [a - b for a, b in zip(lo, before)]
    out = np.full([h - l + b + a for l, h, b, a in zip(lo, hi, before, after)], -1, dtype=np.int16)
    untile_into(values, inner, origin, lo, hi, out, out_origin)
    inside = tuple(slice(b, b + h - l) for l, h, b in zip(lo, hi, before))
    np.testing.assert_array_equal(out[inside], _reference(values, inner, origin, lo, hi))
    untouched = np.ones(out.shape, dtype=bool)
    untouched[inside] = False
    assert (out[untouched] == -1).all(), "wrote outside the wanted box"


def test_a_box_inside_one_inner_chunk_and_an_empty_box():
    values = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)  # block [2, 3] of [4, 5] chunks
    out = np.zeros((2, 2), dtype=np.float32)
    untile_into(values, (4, 5), (0, 0), (5, 6), (7, 8), out, (5, 6))
    np.testing.assert_array_equal(out, values[1, 1, 1:3, 1:3])
    untile_into(values, (4, 5), (0, 0), (5, 6), (5, 8), out, (5, 6))  # empty: nothing written, no error
    np.testing.assert_array_equal(out, values[1, 1, 1:3, 1:3])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 4), max_size=3).flatmap(
    lambda shape: st.tuples(st.just(shape), st.integers(0, int(np.prod(shape))), st.integers(0, int(np.prod(shape))))))
def test_linear_boxes_cover_the_range_in_order(case):
    shape, a, b = case
    start, stop = min(a, b), max(a, b)
    seen = []
    boxes = linear_boxes(shape, start, stop)
    for lo, hi in boxes:
        assert all(x < y for x, y in zip(lo, hi))
        seen += np.ravel_multi_index(np.indices([y - x for x, y in zip(lo, hi)]).reshape(len(shape), -1)
                                     + np.asarray(lo, dtype=int).reshape(-1, 1), shape).tolist() if shape else [0]
    assert seen == list(range(start, stop))
    assert len(boxes) <= max(2 * len(shape) - 1, 1)


@st.composite
def _blocks(draw):
    ndim = draw(st.integers(1, 3))
    grid = [draw(st.integers(1, 4)) for _ in range(ndim)]
    first = [draw(st.integers(0, g - 1)) for g in grid]
    last = [draw(st.integers(f + 1, g)) for f, g in zip(first, grid)]
    return grid, draw(st.permutations(range(ndim))), first, last, draw(st.integers(1, 6))


@settings(max_examples=150, deadline=None)
@given(_blocks())
def test_a_stored_block_views_exactly_its_inner_chunks(case):
    grid, order, first, last, piece = case
    fmt = shards.ShardFormat(tuple(grid), (1,) * len(grid), piece, first=tuple(order[:1]))
    stored = np.random.default_rng(0).integers(0, 256, (fmt.pieces, piece), dtype=np.uint8)
    block = np.indices([b - a for a, b in zip(first, last)]).reshape(len(grid), -1).T + np.asarray(first)
    positions = np.sort(fmt.position(block))
    span = stored[positions[0]:positions[-1] + 1].reshape(-1)
    view = stored_block(span, fmt.grid, fmt.order, piece, first, last)
    assert view.shape == (*[last[d] - first[d] for d in fmt.order], piece)
    np.testing.assert_array_equal(view.reshape(-1, piece), stored[positions])  # storage order, row-major


@pytest.mark.parametrize("layout,max_request", [("packed", None), ("plain", None), ("packed", 1500)])
def test_random_boxes_read_back_exactly(tmp_path, layout, max_request):
    """Boxes that cut inner chunks anywhere, of tensors whose shapes the chunks do not divide, read back
    exactly, whatever runs of stored inner chunks they take (3-D tensors store their grid transposed),
    also where requests are cut shorter than a run (so are runs, and whole chunks)."""
    rng = np.random.default_rng(0)
    state = {"a": torch.arange(37 * 29 * 11, dtype=torch.float32).reshape(37, 29, 11),
             "b": torch.arange(203 * 77, dtype=torch.int32).reshape(203, 77).to(torch.bfloat16),
             "c": torch.arange(1001, dtype=torch.int64)}
    path = str(tmp_path / "ck")
    tsckpt.save(state, path, layout=layout, inner_chunk_bytes=512)
    where = path if max_request is None else {"url": path, "read_cost": {"max_request": max_request}}
    with tsckpt.open(where) as ck:
        for name, tensor in state.items():
            whole = tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
            for _ in range(40):
                lo = [int(rng.integers(0, n)) for n in tensor.shape]
                hi = [int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, tensor.shape)]
                box = tuple(slice(a, b) for a, b in zip(lo, hi))
                np.testing.assert_array_equal(ck[name][box].float().numpy() if tensor.dtype == torch.bfloat16
                                              else ck[name][box].numpy(), whole[box], err_msg=f"{name}{box}")
