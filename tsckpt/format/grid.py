"""Chunk grids: from the regions ranks write to a regular Zarr grid each rank can write alone. Outer chunks
are aligned to every region boundary (the gcd of the interior boundaries along each dimension), so each lies
in one rank's region. :class:`ChunkGrid` is the one place that walks a grid's chunks."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes)

#: Above this many distinct cells the regions are too fragmented to be a real save plan.
_MAX_TILING_CELLS = 1 << 26
#: Up to this many boxes, the common cases are decided in plain Python: numpy's cost per call
#: (microseconds) is most of a tensor's planning when a save has hundreds of tensors on a few ranks.
FEW_BOXES = 32


def check_tiling(name: str, shape: Sequence[int], boxes: Sequence[Box]) -> None:
    """Raise unless the non-empty boxes lie inside ``shape`` and cover it exactly once.

    ``boxes``: ``(offsets, sizes)`` pairs, or (faster for thousands of ranks) an int array ``(len(boxes), 2,
    ndim)``. The boxes' boundaries cut the shape into cells, each covered once: counted with a difference array
    and a cumulative sum per dimension, never comparing two boxes."""
    ndim = len(shape)
    if len(boxes) <= FEW_BOXES and _slabs_tile(shape, boxes):
        return
    try:
        box_array = np.asarray(boxes, dtype=np.int64).reshape(len(boxes), 2, ndim)
    except ValueError:  # ragged: some box has the wrong number of dimensions
        bad = next((o, s) for o, s in boxes if len(o) != ndim or len(s) != ndim)
        raise PlanError(f"tensor {name!r}: region offsets={list(bad[0])} sizes={list(bad[1])} "
                        f"falls outside its shape {list(shape)}") from None
    box_array = box_array[box_array[:, 1].prod(axis=1) > 0] if ndim else box_array
    lo, hi = box_array[:, 0], box_array[:, 0] + box_array[:, 1]
    outside = (lo < 0).any(axis=1) | (hi > np.asarray(shape, dtype=np.int64)).any(axis=1)
    if outside.any():
        o, s = box_array[int(np.argmax(outside))]
        raise PlanError(f"tensor {name!r}: region offsets={o.tolist()} sizes={s.tolist()} "
                        f"falls outside its shape {list(shape)}")
    if math.prod(shape) == 0:
        return
    if not len(box_array):
        raise PlanError(f"tensor {name!r}: the saved regions do not cover shape {list(shape)} "
                        f"exactly once (no region holds any of it)")
    if ndim == 0:
        if len(box_array) > 1:
            raise PlanError(f"tensor {name!r}: {len(box_array)} regions overlap on a 0-d tensor")
        return
    if _one_dimensional_cover(lo, hi, shape):
        return
    cuts = [np.unique(np.concatenate(([0, n], lo[:, d], hi[:, d]))) for d, n in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > _MAX_TILING_CELLS:
        raise PlanError(f"tensor {name!r}: {len(box_array)} regions cut shape {list(shape)} into {cells} "
                        f"distinct cells, more than the {_MAX_TILING_CELLS} tsckpt checks")
    # Compressed index of every box corner; one extra slot per dim takes the "hi" edges.
    ilo = np.stack([np.searchsorted(cuts[d], lo[:, d]) for d in range(ndim)], axis=1)
    ihi = np.stack([np.searchsorted(cuts[d], hi[:, d]) for d in range(ndim)], axis=1)
    dims = [len(c) for c in cuts]
    diff = np.zeros(math.prod(dims), dtype=np.int64)
    for corner in itertools.product((0, 1), repeat=ndim):
        flat = np.ravel_multi_index(tuple(np.where(c, ihi[:, d], ilo[:, d]) for d, c in enumerate(corner)), dims)
        diff += (-1 if sum(corner) % 2 else 1) * np.bincount(flat, minlength=diff.size)
    cover = diff.reshape(dims)
    for d in range(ndim):
        cover = np.cumsum(cover, axis=d)
    cover = cover[tuple(slice(0, len(c) - 1) for c in cuts)]
    if (cover == 1).all():
        return
    cell = np.unravel_index(int(np.argmax(cover != 1)), cover.shape)
    at = [int(cuts[d][i]) for d, i in enumerate(cell)]
    if cover[cell] > 1:
        holders = [o.tolist() for o, h in zip(lo, hi) if ((o <= at) & (np.asarray(at) < h)).all()]
        raise PlanError(f"tensor {name!r}: regions at {holders[0]} and {holders[1]} overlap "
                        f"(both hold the element at {at})")
    raise PlanError(f"tensor {name!r}: the saved regions do not cover shape {list(shape)} "
                    f"exactly once (no region holds the element at {at})")


def _one_dimensional_cover(lo: np.ndarray, hi: np.ndarray, shape: Sequence[int]) -> bool:
    """Whether the boxes are slabs of one dimension that tile it end to end (FSDP's and Shard(d)'s case), by a
    sort; False leaves it to the general count."""
    full = (lo == 0) & (hi == np.asarray(shape, dtype=np.int64))
    split = np.flatnonzero(~full.all(axis=0))
    if len(split) > 1:
        return False
    if len(split) == 0:
        return len(lo) == 1
    d = int(split[0])
    if not np.delete(full, d, axis=1).all():
        return False
    order = np.argsort(lo[:, d], kind="stable")
    starts, ends = lo[order, d], hi[order, d]
    return bool(starts[0] == 0 and ends[-1] == shape[d] and (starts[1:] == ends[:-1]).all())


def _slabs_tile(shape: Sequence[int], boxes: Sequence[Box] | np.ndarray) -> bool:
    """:func:`_one_dimensional_cover` for a few boxes, in plain Python, boxes inside ``shape`` checked too;
    False sends every other case, errors included, to the general check."""
    ndim = len(shape)
    cut: set[int] = set()
    kept = []
    for offsets, sizes in boxes.tolist() if isinstance(boxes, np.ndarray) else boxes:
        if len(offsets) != ndim or len(sizes) != ndim or any(n < 0 for n in sizes):
            return False
        if 0 in sizes:
            continue
        kept.append((offsets, sizes))
        cut.update(d for d in range(ndim) if offsets[d] != 0 or sizes[d] != shape[d])
    if len(cut) != 1:
        return not cut and len(kept) == 1
    (d,) = cut
    spans = sorted((o[d], o[d] + s[d]) for o, s in kept)
    return spans[0][0] == 0 and spans[-1][1] == shape[d] and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def aligned_chunk_shape(shape: Sequence[int], boxes: Sequence[Box] | np.ndarray) -> tuple[int, ...]:
    """The largest regular chunk shape whose boundaries include every box boundary (``boxes`` as for
    :func:`check_tiling`; empty boxes place no boundary)."""
    if len(boxes) <= FEW_BOXES:
        listed = boxes.tolist() if isinstance(boxes, np.ndarray) else boxes
        kept = [(o, s) for o, s in listed if all(n > 0 for n in s)]
        return tuple(
            functools.reduce(math.gcd, (e for o, s in kept for e in (o[d], o[d] + s[d]) if 0 < e < n), 0)
            or max(n, 1)
            for d, n in enumerate(shape))
    ndim = len(shape)
    box_array = np.asarray(boxes, dtype=np.int64).reshape(len(boxes), 2, ndim)
    box_array = box_array[box_array[:, 1].prod(axis=1) > 0]
    chunk = []
    for d, n in enumerate(shape):
        edges = np.concatenate((box_array[:, 0, d], box_array[:, 0, d] + box_array[:, 1, d]))
        interior = edges[(edges > 0) & (edges < n)]
        chunk.append(int(np.gcd.reduce(interior)) if interior.size else max(n, 1))
    return tuple(chunk)


@dataclass(frozen=True)
class ChunkGrid:
    """How a tensor's array is cut into files (chunks) and, inside them, inner chunks."""

    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...] | None = None

    @functools.cached_property  # cached: a save or load asks each array's grid thousands of times
    def grid_shape(self) -> tuple[int, ...]:
        """Number of chunks along each dimension."""
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunk_shape))

    @functools.cached_property
    def nchunks(self) -> int:
        return math.prod(self.grid_shape)

    def indices(self) -> Iterator[tuple[int, ...]]:
        """Every chunk's grid index, in row-major order (none for an empty tensor, ``()`` for a 0-d one)."""
        return itertools.product(*(range(g) for g in self.grid_shape))

    def chunk_region(self, index: Sequence[int]) -> tuple[slice, ...]:
        """The box of the tensor held by chunk ``index`` (clipped at the edges)."""
        return tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, self.chunk_shape, self.shape))

    def chunks_overlapping(self, region: Sequence[slice]) -> list[tuple[int, ...]]:
        """Indices of the chunks that a box of unit-step slices touches."""
        ranges = [range(s.start // c, (s.stop - 1) // c + 1) if s.stop > s.start else range(0)
                  for s, c in zip(region, self.chunk_shape)]
        return list(itertools.product(*ranges))

    def flat_index(self, index: Sequence[int]) -> int:
        """A chunk's position in row-major order of the grid."""
        flat = 0
        for i, g in zip(index, self.grid_shape):
            flat = flat * g + i
        return flat

    def chunks_within(self, offsets: Sequence[int],
                      sizes: Sequence[int]) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...]]]:
        """The chunks lying entirely inside a box (at the array's edge: once the box reaches the edge), each with
        its slice relative to the box."""
        if math.prod(sizes) == 0:
            return
        for index in itertools.product(*self._ranges_within(offsets, sizes)):
            yield index, tuple(slice(i * c - o, min((i + 1) * c, n) - o)
                               for i, c, o, n in zip(index, self.chunk_shape, offsets, self.shape))

    def flat_indices_within(self, offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """:meth:`flat_index` of every chunk :meth:`chunks_within` gives, in its order, as one array."""
        if math.prod(sizes) == 0:
            return np.zeros(0, dtype=np.int64)
        axes = [np.arange(r.start, r.stop, dtype=np.int64) for r in self._ranges_within(offsets, sizes)]
        if not axes:  # a 0-d array: its one chunk
            return np.zeros(1, dtype=np.int64)
        return np.ravel_multi_index(np.meshgrid(*axes, indexing="ij"), self.grid_shape).reshape(-1)

    def _ranges_within(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[range]:
        ranges = []
        for n, c, o, s in zip(self.shape, self.chunk_shape, offsets, sizes):
            end = o + s
            first, last = -(-o // c), (end // c if end < n else -(-n // c))
            ranges.append(range(first, max(first, last)))
        return ranges

