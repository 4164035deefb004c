"""Where a rank's values go in its data file. Any order is valid (the index says where each value is); the
order decides how many byte ranges a load needs. A load cutting tensors along another dimension than the save
did needs one band of every tensor of a file: stored band by band across tensors, that is one range per file.
Bands are cut only where requests are dear (:meth:`~tsckpt.storage.layouts.KvLayout.bands`)."""

from __future__ import annotations

from collections.abc import Sequence

from .grid import ChunkGrid


def sort_key(grid: ChunkGrid, index: Sequence[int], tensor: int) -> tuple[float | int, ...]:
    """The place of outer chunk ``index`` of a tensor laid out as ``grid`` among a rank's values: scalars first
    (every load needs them), then tensors not cut into bands (kept together), then banded chunks by where they
    start along dimensions 1, 2, ..., 0, as fractions of each (tensors of any width interleave band by band);
    ties by ``tensor`` (its place among the rank's tensors) and ``index``."""
    shape, chunk = grid.shape, grid.chunk_shape
    if len(shape) < 2 or all(n == 1 for n in grid.grid_shape[1:]):
        return (0, len(shape) > 0, tensor, *index)
    dims = (*range(1, len(shape)), 0)
    return (1, *(index[d] * chunk[d] / max(shape[d], 1) for d in dims), tensor, *index)


def stripe_dims(grid: ChunkGrid) -> tuple[int, ...]:
    """The dimensions along which a sharded tensor's values lie in order in every file, best first: cut by where
    chunks start along one, a piece is one run of each file. Dimension 0 first where it has several chunks
    (pieces are then whole rows), then dimension 1 for a tensor cut into bands along it."""
    if grid.nchunks <= 1:
        return ()
    dims = [0] if grid.grid_shape[0] > 1 else []
    if len(grid.shape) >= 2 and grid.grid_shape[1] > 1:
        dims.append(1)
    return tuple(dims)
