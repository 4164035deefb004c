"""Copying what a box wants of a block of inner chunks (each stored contiguously: ``(*block, *inner)``) into
place: the inner chunks wholly inside the box are untiled straight into the destination, only the rim goes
through a small buffer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .shards import tile_views

Range = tuple[int, int]


def untile_into(values: np.ndarray, inner: Sequence[int], origin: Sequence[int], lo: Sequence[int],
                hi: Sequence[int], out: np.ndarray, out_origin: Sequence[int]) -> None:
    """Copy ``[lo, hi)`` (array coordinates, inside both the block and ``out``) of the block ``values`` into
    ``out``. ``values``: whole inner chunks shaped ``(*block, *inner)`` (a contiguous last axis), the first at
    array coordinates ``origin``; ``out``: the destination, its element 0 at ``out_origin``."""
    ndim = len(inner)
    block = values.shape[:ndim]
    if any(b <= a for a, b in zip(lo, hi)):
        return
    # Inner chunks wholly inside [lo, hi), along each dimension.
    first = [min(max(-(-(a - o) // i), 0), n) for a, o, i, n in zip(lo, origin, inner, block)]
    stop = [max(min((b - o) // i, n), f) for b, o, i, n, f in zip(hi, origin, inner, block, first)]
    _copy(values, inner, origin, lo, hi, out, out_origin, list(zip(first, stop)), direct=True)
    for d in range(ndim):
        for rim in ((0, first[d]), (stop[d], block[d])):
            if rim[1] > rim[0]:
                ranges = [*zip(first[:d], stop[:d]), rim, *((0, n) for n in block[d + 1:])]
                _copy(values, inner, origin, lo, hi, out, out_origin, ranges, direct=False)


def _copy(values: np.ndarray, inner: Sequence[int], origin: Sequence[int], lo: Sequence[int], hi: Sequence[int],
          out: np.ndarray, out_origin: Sequence[int], ranges: list[Range], direct: bool) -> None:
    """Copy what ``[lo, hi)`` wants of the inner chunks ``ranges`` of the block: straight into ``out``
    (``direct``), or through a buffer."""
    if any(b <= a for a, b in ranges):
        return
    sub = values[tuple(slice(a, b) for a, b in ranges)]
    block = [b - a for a, b in ranges]
    start = [o + a * i for o, (a, _), i in zip(origin, ranges, inner)]
    span = [n * i for n, i in zip(block, inner)]
    a = [max(s, x) for s, x in zip(start, lo)]
    b = [min(s + n, y) for s, n, y in zip(start, span, hi)]
    if any(y <= x for x, y in zip(a, b)):
        return
    dest = out[(*(slice(x - o, y - o) for x, y, o in zip(a, b, out_origin)), ...)]  # a view, even 0-d
    if direct:
        tiles, pieces = tile_views(dest, sub, block, inner)
        np.copyto(tiles, pieces)
        return
    full = np.empty(span, dtype=values.dtype)
    tiles, pieces = tile_views(full, sub, block, inner)
    np.copyto(tiles, pieces)
    np.copyto(dest, full[tuple(slice(x - s, y - s) for x, y, s in zip(a, b, start))])


def stored_block(span: np.ndarray, grid: Sequence[int], order: Sequence[int], piece_bytes: int,
                 first: Sequence[int], last: Sequence[int]) -> np.ndarray:
    """The inner chunks ``[first, last)`` of an outer chunk, as views of ``span``: ``(*block, piece_bytes)`` in
    storage order (``order``'s dimensions, slowest first), strided over the pieces between them. ``span``: the
    stored bytes from the block's first inner chunk to its last, pieces outside the block included; ``grid``:
    the chunk's inner grid."""
    ndim = len(grid)
    count = [last[d] - first[d] for d in order]
    stride, strides = piece_bytes, [0] * ndim
    for k in reversed(range(ndim)):
        strides[k] = stride
        stride *= grid[order[k]]
    extent = sum((n - 1) * st for n, st in zip(count, strides)) + piece_bytes
    assert span.ndim == 1 and span.strides == (1,) and span.size >= extent, "the span holds the block"
    return np.lib.stride_tricks.as_strided(span, (*count, piece_bytes), (*strides, 1), writeable=False)


def linear_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Positions ``[start, stop)`` of the row-major order of a grid of ``shape`` as at most ``2 * len(shape) - 1``
    boxes ``(lo, hi)``, in order: a run of stored inner chunks as blocks its bytes can be untiled from as views."""
    if stop <= start:
        return []
    if not shape:
        return [((), ())]
    inner = 1
    for n in shape[1:]:
        inner *= n
    (i0, r0), (i1, r1) = divmod(start, inner), divmod(stop, inner)
    rest = shape[1:]

    def rows(i: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((i, *lo), (i + 1, *hi)) for lo, hi in linear_boxes(rest, a, b)]

    if i0 == i1:
        return rows(i0, r0, r1)
    out = []
    if r0:
        out += rows(i0, r0, inner)
        i0 += 1
    if i1 > i0:
        out.append(((i0, *(0 for _ in rest)), (i1, *rest)))
    if r1:
        out += rows(i1, 0, r1)
    return out
