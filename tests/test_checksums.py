"""Chunk checksum tables: computed per written region, checked on reads that cover chunks whole."""

import numpy as np
import pytest

from tsckpt.errors import ChecksumError
from tsckpt.format import checksums
from tsckpt.format.grid import ChunkGrid


def _save(full, grid, regions):
    crcs = []
    for o, s in regions:
        crcs += zip(*checksums.region_checksums(full[tuple(slice(a, a + b) for a, b in zip(o, s))], grid, o))
    return checksums.decode_table(checksums.encode_table(grid, *zip(*crcs)), grid, "t")


def test_row_regions_round_trip_and_partial_reads():
    full = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    grid = ChunkGrid((10, 6), (3, 6))
    table = _save(full, grid, [((0, 0), (3, 6)), ((3, 0), (3, 6)), ((6, 0), (3, 6)), ((9, 0), (1, 6))])
    assert checksums.check_region(full, grid, (0, 0), table, "t") == 4
    # a column slice covers no chunk whole: nothing to check, nothing wrongly refused
    assert checksums.check_region(full[:, :2], grid, (0, 0), table, "t") == 0
    # rows 3..9 cover chunks 1 and 2 whole, and the edge chunk 3 (row 9 only) since the edge is reached
    assert checksums.check_region(full[3:], grid, (3, 0), table, "t") == 3
    damaged = full.copy()
    damaged.reshape(-1).view(np.uint8)[4 * 6 * 7 + 1] ^= 1
    with pytest.raises(ChecksumError, match=r"t: chunk \[2, 0\]"):
        checksums.check_region(damaged, grid, (0, 0), table, "t")


def test_irregular_two_dimensional_and_zero_d_grids():
    full = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float16)
    grid = ChunkGrid((6, 8), (3, 4))
    table = _save(full, grid, [((r, c), (3, 4)) for r in (0, 3) for c in (0, 4)])
    assert checksums.check_region(full, grid, (0, 0), table, "t") == 4
    rows = ChunkGrid((6, 8), (1, 8))  # a rank writing rows 1..4 writes three chunks
    t = _save(full, rows, [((0, 0), (1, 8)), ((1, 0), (3, 8)), ((4, 0), (2, 8))])
    assert checksums.check_region(full, rows, (0, 0), t, "t") == 6
    scalar = np.array(3.5, dtype=np.float64)
    t0 = _save(scalar, ChunkGrid((), ()), [((), ())])
    assert checksums.check_region(scalar, ChunkGrid((), ()), (), t0, "s") == 1


def test_tables_that_do_not_fit_are_refused():
    grid = ChunkGrid((9,), (3,))
    with pytest.raises(ChecksumError, match=r"chunk \[2\] was never written"):
        checksums.encode_table(grid, [0, 1], [1, 2])
    text = checksums.encode_table(grid, [0, 1, 2], [1, 2, 3])
    with pytest.raises(ChecksumError, match="3 entries, the grid has 4"):
        checksums.decode_table(text, ChunkGrid((12,), (3,)), "t")
    with pytest.raises(ChecksumError, match="not valid base64"):
        checksums.decode_table("%%%", grid, "t")
