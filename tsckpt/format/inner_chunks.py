"""Inner chunks chosen so that loads into other topologies fetch little more than they need.

An inner chunk is the smallest piece a read fetches and the piece each crc32c covers. Along each dimension it
is the largest size for which no rank of a ``torch.chunk``-style split into ``k`` in :data:`SPLITS` fetches
more than :data:`TARGET_RATIO` times what it needs; below the floor (the writer's ``min_bytes``, lowered for
small outer chunks, at most :data:`MAX_PER_TENSOR` per tensor), the sizes above it with the least worst ratio
win. Along a dimension the saved regions cut, inner chunks divide the outer chunk; along an uncut one, with
``bands``, a sharded tensor's outer chunk is one inner chunk wide (at least :data:`MIN_BAND_BYTES`), else the
dimension rounded up to whole inner chunks."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import numpy as np

#: The rank counts a later load is planned for, along any one dimension.
SPLITS = (2, 3, 4, 8)
#: The most a rank may fetch along a dimension, relative to what it needs (below the 1.3 documented for loads).
TARGET_RATIO = 1.2
#: An outer chunk smaller than this many times the writer's floor is cut into up to this many pieces of at least
#: MIN_PIECE_BYTES instead.
SMALL_PIECES = 16
MIN_PIECE_BYTES = 512
#: The smallest band a sharded tensor is cut into (a page: below it a value's index and digest entries are no
#: longer small beside it); smaller regions stay one outer chunk of inner chunks.
MIN_BAND_BYTES = 4 << 10
#: The most inner chunks a tensor is cut into (unless it has more outer chunks).
MAX_PER_TENSOR = 1024
#: Candidate sizes along a free dimension: the length divided by 1..this, and powers of two.
_MAX_PIECES = 256


def fetched(n: int, unit: int, start: int, stop: int) -> int:
    """Elements fetched along a dimension of length ``n`` cut every ``unit`` to read ``[start, stop)``."""
    if stop <= start:
        return 0
    return min(-(-stop // unit) * unit, n) - (start // unit) * unit


def over_read(n: int, unit: int, splits: Iterable[int] = SPLITS) -> float:
    """The worst ratio of fetched to needed over every rank of every split in ``splits``."""
    worst = 1.0
    for k in splits:
        size = -(-n // k)
        for start in range(0, n, size):
            stop = min(start + size, n)
            worst = max(worst, fetched(n, unit, start, stop) / (stop - start))
    return worst


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


def _candidates(n: int, chunk: int) -> list[int]:
    """Inner sizes possible along one dimension, ascending."""
    if chunk < max(n, 1):  # region boundaries fix the outer chunk: inner chunks divide it
        return divisors(chunk)
    if n <= 1:
        return [1]
    sizes = {-(-n // m) for m in range(1, _MAX_PIECES + 1)} | {1 << e for e in range(n.bit_length() - 1)}
    return sorted(sizes)


def _coarsest_fit(cands: list[list[int]], ratios: list[np.ndarray], fine: list[int], min_elems: int) -> list[int]:
    """Sizes of at least ``min_elems`` elements in all whose worst ratio is least (then: fewest inner chunks):
    every combination for up to two dimensions, else coarsened a step at a time where the ratio grows least."""
    if len(cands) <= 2:
        grids = np.meshgrid(*[np.asarray(c, dtype=np.int64) for c in cands], indexing="ij")
        each = np.meshgrid(*ratios, indexing="ij")
        elems = np.multiply.reduce(grids).reshape(-1)
        ok = elems >= min_elems
        if not ok.any():
            return [c[-1] for c in cands]
        # Least worst ratio, then least total (the other dimension's loads), then fewest inner chunks.
        order = np.lexsort((-elems, np.add.reduce(each).reshape(-1), np.maximum.reduce(each).reshape(-1), ~ok))
        return [int(g.reshape(-1)[order[0]]) for g in grids]
    pick = list(fine)
    while math.prod(pick) < min_elems:
        steps = [(float(ratios[d][cands[d].index(nxt)]), -nxt / pick[d], d, nxt) for d in range(len(pick))
                 for nxt in [next((u for u in cands[d] if u > pick[d]), None)] if nxt is not None]
        if not steps:
            break
        _, _, d, nxt = min(steps)
        pick[d] = nxt
    return pick


def choose(shape: Sequence[int], chunk: Sequence[int], itemsize: int, *, min_bytes: int,
           max_bytes: int | None = None, bands: bool = False) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The outer chunk shape (free dimensions rounded up) and the inner chunk shape, or None for no inner chunks.

    ``chunk``: the outer chunk aligned to the saved regions (:func:`~tsckpt.format.grid.aligned_chunk_shape`);
    ``min_bytes``: the smallest inner chunk worth a read of its own (0: no inner chunks); ``max_bytes``: the
    largest; ``bands``: cut a sharded tensor's outer chunks into bands one inner chunk wide."""
    return _choose(tuple(shape), tuple(chunk), itemsize, min_bytes, max_bytes, bands)


@functools.lru_cache(maxsize=1024)  # a model's layers repeat a few shapes
def _choose(shape: tuple[int, ...], chunk: tuple[int, ...], itemsize: int, min_bytes: int,
            max_bytes: int | None, bands: bool) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    if min_bytes <= 0 or not math.prod(shape) or math.prod(chunk) * itemsize <= min(min_bytes, MIN_PIECE_BYTES):
        return chunk, None
    cands = [_candidates(n, c) for n, c in zip(shape, chunk)]
    ratios = [np.array([over_read(n, u) for u in cs]) for n, cs in zip(shape, cands)]
    # Finest that is fine enough: the largest size whose ratio meets the target, per dimension.
    pick = [max(u for u, r in zip(cs, rs) if r <= TARGET_RATIO) for cs, rs in zip(cands, ratios)]
    # The floor: lowered for outer chunks too small to hold SMALL_PIECES of it; at most MAX_PER_TENSOR pieces.
    chunk_bytes = math.prod(chunk) * itemsize
    floor = min(min_bytes, max(MIN_PIECE_BYTES, chunk_bytes // SMALL_PIECES))
    min_elems = max(-(-floor // itemsize), -(-math.prod(shape) // MAX_PER_TENSOR))
    if math.prod(pick) < min_elems:
        pick = _coarsest_fit(cands, ratios, pick, min_elems)
    while max_bytes and math.prod(pick) * itemsize > max_bytes:
        d = max(range(len(pick)), key=lambda i: pick[i])
        smaller = [u for u in cands[d] if u < pick[d]]
        if not smaller:
            break
        pick[d] = smaller[-1]
    # Bands: one inner chunk wide along every dimension no region cuts, and not below MIN_BAND_BYTES.
    banded = tuple(c if c < max(n, 1) else u for n, c, u in zip(shape, chunk, pick))
    cut = bands and any(c < max(n, 1) for n, c in zip(shape, chunk)) and math.prod(banded) * itemsize >= MIN_BAND_BYTES
    outer = banded if cut else tuple(c if c < max(n, 1) else -(-n // u) * u for n, c, u in zip(shape, chunk, pick))
    inner = tuple(pick)
    if inner == outer:  # one inner chunk per outer chunk: no sharding codec (bands stay bands)
        return outer if cut else chunk, None
    return outer, inner
