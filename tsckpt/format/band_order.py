"""Where a rank's values go in its data file: in the order that keeps what other topologies read together.

A rank's data file (the packed layout) holds one value per outer chunk it
saved, and the index says where each one is, so any order is valid: a reader
never assumes one. The order only decides how many byte ranges a load needs.
A load into the same topology, or a replicated one, reads whole files, which
is one range whatever the order. A load that cuts the tensors along another
dimension than the save did (a column block of a row-sharded save) needs,
from every tensor of a source file, the outer chunks of one band: stored band
by band across tensors, that is one range per source file instead of one per
tensor.

Bands are cut only where a request is dear (packed saves to object stores,
:meth:`~tsckpt.storage.layouts.KvLayout.bands`); elsewhere a rank writes its
values in the order of the save, which a same-topology load reads in turn.
Where bands are cut, values are ordered by :func:`sort_key`: scalars first (every
replica of a load needs them, and they are fetched on their own, ahead of the
rest), banded tensors after the rest (biases, norms, and tensors too small to be cut into bands,
whose every outer chunk spans all the columns: each such chunk holds a piece of
every column block a load takes, so kept together they cost a column block one
short range instead of scattering its pieces among another block's bands),
then by where the outer chunk starts along dimension 1, 2, ... and
lastly 0, each as a fraction of the dimension (so tensors of different widths
interleave band by band), then by the tensor's place in the save and the
chunk's place in its grid. Pure functions; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from .grid import ChunkGrid


def sort_key(grid: ChunkGrid, index: Sequence[int], tensor: int) -> tuple[float | int, ...]:
    """The place of outer chunk ``index`` of a tensor laid out as ``grid`` among a rank's values.

    ``tensor`` is the tensor's position among those the rank saves (a tie-break
    that keeps a tensor's chunks together where nothing else separates them).
    """
    shape, chunk = grid.shape, grid.chunk_shape
    if len(shape) < 2 or all(n == 1 for n in grid.grid_shape[1:]):
        return (0, len(shape) > 0, tensor, *index)
    dims = (*range(1, len(shape)), 0)
    return (1, *(index[d] * chunk[d] / max(shape[d], 1) for d in dims), tensor, *index)


def stripe_dims(grid: ChunkGrid) -> tuple[int, ...]:
    """The dimensions along which the values of a sharded tensor lie in order in every file, best first; none
    where the tensor is one value, and a piece of it is best fetched with the rest of it.

    Cut into ``m`` pieces at its outer chunks, piece ``k`` taking the chunks
    that start in ``[k/m, (k+1)/m)`` of a dimension given here, a piece is one
    run of each file it touches. Dimension 0 comes first where the tensor has
    several outer chunks along it (a row-sharded save): its pieces are then
    also whole rows, which lie in one run of a destination too (they are
    read, sent and received in place, with no buffer), and a piece mostly
    lies in its own ranks' files. Dimension 1 follows for a tensor of two or
    more dimensions cut into bands along it (the order of :func:`sort_key`).
    """
    if grid.nchunks <= 1:
        return ()
    dims = [0] if grid.grid_shape[0] > 1 else []
    if len(grid.shape) >= 2 and grid.grid_shape[1] > 1:
        dims.append(1)
    return tuple(dims)
