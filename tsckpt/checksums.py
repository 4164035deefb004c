"""Chunk checksums: a crc32c of every outer chunk's elements, computed beside the write.

Each tensor's table holds one crc32c per outer chunk of its Zarr grid, in C
order of the grid, over the chunk's elements as they lie in memory: C order,
little-endian, no padding; a chunk that overhangs the array's edge covers only
the elements inside the array. The table is independent of the codecs, so the
same value is checked whatever the chunk was stored as, and any Zarr reader can
check it (read the chunk, crc32c its bytes).

Saving costs one pass of a hardware crc32c (several GB/s per core) over data
that is being written anyway, run while TensorStore's threads do the I/O.
Reading checks every chunk a read covers entirely: a same-topology load, a
whole-tensor read and ``verify`` check everything; a resharded slice that
cuts through chunks checks the chunks it covers whole (``docs/format.md``).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator, Sequence

import crc32c as _crc32c
import numpy as np

from .errors import ChecksumError

ALGORITHM = "crc32c"


def crc32c(data: np.ndarray | bytes) -> int:
    """The crc32c of an array's elements in C order (copies only if not contiguous)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return _crc32c.crc32c(data)


def covered_chunks(
    shape: Sequence[int], chunk: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]
) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...]]]:
    """The chunks lying entirely inside the box, each with its slice relative to the box.

    A chunk at the array's edge counts as entirely inside when the box reaches
    the edge, since the part beyond the edge holds no elements.
    """
    if not shape:
        if math.prod(sizes) > 0:
            yield (), ()
        return
    ranges = []
    for n, c, o, s in zip(shape, chunk, offsets, sizes):
        first = -(-o // c)
        end = o + s
        last = end // c if end < n else -(-n // c)
        ranges.append(range(first, max(first, last)))
    for index in _product(ranges):
        yield index, tuple(
            slice(i * c - o, min((i + 1) * c, n) - o) for i, c, o, n in zip(index, chunk, offsets, shape)
        )


def _product(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for tail in _product(ranges[1:]):
            yield (head, *tail)


def region_checksums(
    data: np.ndarray, shape: Sequence[int], chunk: Sequence[int], offsets: Sequence[int]
) -> list[tuple[int, int]]:
    """``(flat chunk index, crc32c)`` of every chunk of a written region.

    ``data`` is the region's elements at ``offsets``; regions are aligned to
    the grid, so every chunk they touch lies wholly inside them.
    """
    grid = _grid(shape, chunk)
    return [
        (int(np.ravel_multi_index(index, grid)) if grid else 0, crc32c(data[view]))
        for index, view in covered_chunks(shape, chunk, offsets, data.shape)
    ]


def _grid(shape: Sequence[int], chunk: Sequence[int]) -> tuple[int, ...]:
    return tuple(-(-n // c) for n, c in zip(shape, chunk))


def encode_table(shape: Sequence[int], chunk: Sequence[int], crcs: Sequence[tuple[int, int]]) -> str:
    """The table as stored: base64 of little-endian uint32 values, one per chunk in C order."""
    table = np.zeros(math.prod(_grid(shape, chunk)), dtype="<u4")
    if len(crcs):
        index, value = np.asarray(crcs, dtype=np.int64).T
        table[index] = value
    return base64.b64encode(table.tobytes()).decode("ascii")


def decode_table(text: str, shape: Sequence[int], chunk: Sequence[int], what: str) -> np.ndarray:
    """The stored table as uint32 values; raises when it does not fit the grid."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ChecksumError(f"{what}: the checksum table is not valid base64") from None
    count = math.prod(_grid(shape, chunk))
    if len(raw) != 4 * count:
        raise ChecksumError(f"{what}: the checksum table has {len(raw) // 4} entries, the grid has {count} chunks")
    return np.frombuffer(raw, dtype="<u4")


def check_region(
    data: np.ndarray, shape: Sequence[int], chunk: Sequence[int], offsets: Sequence[int],
    table: np.ndarray, what: str,
) -> int:
    """Check every chunk ``data`` (read at ``offsets``) covers whole; returns how many were checked."""
    grid = _grid(shape, chunk)
    checked = 0
    for index, view in covered_chunks(shape, chunk, offsets, data.shape):
        flat = int(np.ravel_multi_index(index, grid)) if grid else 0
        if crc32c(data[view]) != int(table[flat]):
            raise ChecksumError(f"{what}: chunk {list(index)} does not match its stored crc32c "
                                "(the data was damaged after it was written)")
        checked += 1
    return checked
