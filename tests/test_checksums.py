"""Chunk checksum tables: computed per written region, checked on reads that cover chunks whole."""

import numpy as np
import pytest

from tsckpt import checksums
from tsckpt.errors import ChecksumError


def _save(full, chunk, regions):
    crcs = []
    for o, s in regions:
        view = full[tuple(slice(a, a + b) for a, b in zip(o, s))]
        crcs += checksums.region_checksums(view, full.shape, chunk, o)
    return checksums.decode_table(checksums.encode_table(full.shape, chunk, crcs), full.shape, chunk, "t")


def test_row_and_irregular_regions_round_trip():
    full = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    table = _save(full, (3, 6), [((0, 0), (3, 6)), ((3, 0), (3, 6)), ((6, 0), (3, 6)), ((9, 0), (1, 6))])
    assert checksums.check_region(full, full.shape, (3, 6), (0, 0), table, "t") == 4
    # a column slice covers no chunk whole: nothing to check, nothing wrongly refused
    assert checksums.check_region(full[:, :2], full.shape, (3, 6), (0, 0), table, "t") == 0
    # rows 3..9 cover chunks 1 and 2 whole, and the edge chunk 3 (row 9 only) once the edge is reached
    assert checksums.check_region(full[3:], full.shape, (3, 6), (3, 0), table, "t") == 3
    damaged = full.copy()
    damaged.reshape(-1).view(np.uint8)[4 * 6 * 7 + 1] ^= 1
    with pytest.raises(ChecksumError, match=r"t: chunk \[2, 0\]"):
        checksums.check_region(damaged, full.shape, (3, 6), (0, 0), table, "t")


def test_two_dimensional_grid_and_zero_d():
    full = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float16)
    regions = [((r, c), (3, 4)) for r in (0, 3) for c in (0, 4)]
    table = _save(full, (3, 4), regions)
    assert checksums.check_region(full, full.shape, (3, 4), (0, 0), table, "t") == 4
    scalar = np.array(3.5, dtype=np.float64)
    t0 = _save(scalar, (), [((), ())])
    assert checksums.check_region(scalar, (), (), (), t0, "s") == 1


def test_table_that_does_not_fit_is_refused():
    with pytest.raises(ChecksumError, match="3 entries, the grid has 4"):
        checksums.decode_table(checksums.encode_table((9,), (3,), []), (12,), (3,), "t")
    with pytest.raises(ChecksumError, match="not valid base64"):
        checksums.decode_table("%%%", (3,), (3,), "t")
