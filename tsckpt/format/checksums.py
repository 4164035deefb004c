"""Chunk checksums: a crc32c of every inner chunk's elements, computed beside the write.

Each tensor's table holds one crc32c per piece of its checksum grid
(:attr:`~tsckpt.format.metadata.TensorEntry.checksum_grid`: the inner chunks,
or the outer chunks of an array without inner chunks; the outer chunks in
version-2 checkpoints), in row-major order of that grid, over the piece's
elements as they lie in memory: C order, little-endian, no padding; a piece
that overhangs the array's edge covers only the elements inside the array. The
table does not depend on the codecs, so the same value is checked whatever the
chunk was stored as, and any Zarr reader can check it (read the piece, crc32c
its bytes).

Saving costs one pass of a hardware crc32c (several GB/s per core) over data
being written anyway, while TensorStore's threads do the I/O. Every read checks
every byte it returns: it reads the pieces its box touches whole
(:func:`covering_box`; TensorStore fetches whole inner chunks anyway) and
checks each against the table before handing any part of them out.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import TYPE_CHECKING

import crc32c as _crc32c
import numpy as np

from ..errors import ChecksumError
from .grid import ChunkGrid

if TYPE_CHECKING:  # the metadata validates tables with this module's helpers
    from .metadata import TensorEntry

ALGORITHM = "crc32c"


def crc32c(data: np.ndarray | bytes) -> int:
    """The crc32c of an array's elements in C order (copies only if not contiguous)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return _crc32c.crc32c(data)


def region_checksums(data: np.ndarray, grid: ChunkGrid, offsets: Sequence[int]) -> tuple[list[int], list[int]]:
    """The flat grid index and the crc32c of every chunk of a region written at ``offsets``.

    Regions are aligned to the grid, so every chunk they touch lies wholly inside them.
    """
    indices, crcs = [], []
    for index, view in grid.chunks_within(offsets, data.shape):
        indices.append(grid.flat_index(index))
        crcs.append(crc32c(data[view]))
    return indices, crcs


def encode_table(grid: ChunkGrid, indices: Sequence[int] | np.ndarray, crcs: Sequence[int] | np.ndarray) -> str:
    """The stored table: base64 of little-endian uint32 values, one per chunk in row-major order.

    Raises when a chunk has no checksum: every chunk must have been written.
    """
    return encode_rows(grid, indices, np.asarray(crcs, dtype="<u4").reshape(-1, 1).view(np.uint8))


def encode_rows(grid: ChunkGrid, indices: Sequence[int] | np.ndarray, rows: np.ndarray) -> str:
    """Base64 of one fixed-width row of bytes per chunk (``rows[i]`` for chunk ``indices[i]``), in grid order.

    Raises when a chunk has no row: every chunk must have been written.
    """
    rows = np.asarray(rows, dtype=np.uint8)
    table = np.zeros((grid.nchunks, rows.shape[1] if rows.ndim == 2 else 0), dtype=np.uint8)
    seen = np.zeros(grid.nchunks, dtype=bool)
    indices = np.asarray(indices, dtype=np.int64)
    table[indices] = rows.reshape(len(indices), table.shape[1])
    seen[indices] = True
    if not seen.all():
        missing = np.unravel_index(int(np.argmin(seen)), grid.grid_shape)
        raise ChecksumError(f"chunk {[int(i) for i in missing]} was never written")
    return base64.b64encode(table.tobytes()).decode("ascii")


def decode_rows(text: str, grid: ChunkGrid, width: int, what: str, name: str) -> np.ndarray:
    """A stored table of ``width`` bytes per chunk as a ``(chunks, width)`` array; raises when it does not fit."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ChecksumError(f"{what}: the {name} table is not valid base64") from None
    if len(raw) != width * grid.nchunks:
        raise ChecksumError(f"{what}: the {name} table has {len(raw) // width} entries, "
                            f"the grid has {grid.nchunks} chunks")
    return np.frombuffer(raw, dtype=np.uint8).reshape(grid.nchunks, width)


def table_length(nchunks: int, width: int) -> int:
    """Characters of the base64 text of a table of ``width`` bytes per chunk."""
    return 4 * -(-width * nchunks // 3)


def decode_table(text: str, grid: ChunkGrid, what: str) -> np.ndarray:
    """The stored table as uint32 values; raises when it does not fit the grid."""
    return decode_rows(text, grid, 4, what, "checksum").reshape(-1).view("<u4")


def check_region(data: np.ndarray, grid: ChunkGrid, offsets: Sequence[int], table: np.ndarray, what: str) -> int:
    """Check every chunk ``data`` (read at ``offsets``) covers whole; returns how many were checked."""
    checked = 0
    for index, view in grid.chunks_within(offsets, data.shape):
        if crc32c(data[view]) != int(table[grid.flat_index(index)]):
            raise ChecksumError(f"{what}: chunk {list(index)} does not match its stored crc32c "
                                "(the data changed after it was written)")
        checked += 1
    return checked


def table_of(entry: TensorEntry, what: str) -> np.ndarray | None:
    """``entry``'s decoded table (one value per piece of its checksum grid), or None when it records none.

    Decode it once per tensor when checking many pieces: the table holds one
    value per piece, so decoding it per piece costs pieces x pieces.
    """
    return None if entry.checksums is None else decode_table(entry.checksums, entry.checksum_grid, what)


def covering_box(entry: TensorEntry, offsets: Sequence[int], sizes: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of whole checksummed pieces that holds the box ``offsets``/``sizes`` (clipped at the array's edge).

    Reading this box instead lets every byte handed out be checked. It is the
    box itself when the box is aligned to the pieces, is empty, or nothing is
    checksummed (version 1, ``checksums=False``).
    """
    offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
    if entry.checksums is None or 0 in sizes:
        return offsets, sizes
    unit = entry.checksum_grid.chunk_shape
    lo = tuple(o // u * u for o, u in zip(offsets, unit))
    hi = tuple(min(-(-(o + s) // u) * u, n) for o, s, u, n in zip(offsets, sizes, unit, entry.shape))
    return lo, tuple(h - a for a, h in zip(lo, hi))


def check_read(entry: TensorEntry, data: np.ndarray, offsets: Sequence[int], what: str,
               table: np.ndarray | None = None) -> int:
    """Check every piece ``data`` (read of ``entry`` at ``offsets``) covers whole; returns how many.

    Nothing to check in version-1 checkpoints or without checksums. Callers read
    :func:`covering_box`, so that no piece is covered only in part. ``table``:
    the entry's table from :func:`table_of`, when the caller checks many reads of it.
    """
    if table is None:
        table = table_of(entry, what)
    if table is None:
        return 0
    return check_region(data, entry.checksum_grid, offsets, table, what)
