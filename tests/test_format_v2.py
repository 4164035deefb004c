"""A checkpoint written by tsckpt 0.2 (format version 2: one crc32c per outer chunk) still loads, checked.

``data/format-v2`` was written by ``tsckpt.save`` of tsckpt 0.2 (single process,
plain layout, ``inner_chunk_bytes=1024``): ``w`` is a 64x64 float32 chunk of
16x16 inner chunks with one checksum for the whole chunk, ``b`` ten bfloat16
values in one chunk. Reads of part of ``w`` read the whole outer chunk so its
checksum can be checked.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tsckpt
from damage import edit_key, flip_byte
from tsckpt.errors import ChecksumError

FIXTURE = Path(__file__).parent / "data" / "format-v2"


def _w() -> np.ndarray:
    return (np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 7).astype(np.float32)


def test_version_2_loads_slices_and_verifies():
    ck = tsckpt.open(FIXTURE)
    assert ck.metadata.version == 2 and ck["w"].chunks.inner_chunk_shape == (16, 16)
    np.testing.assert_array_equal(ck["w"].numpy(), _w())
    np.testing.assert_array_equal(ck["w"][3:5, 40:47].numpy(), _w()[3:5, 40:47])
    sd = {"w": torch.zeros(64, 64), "b": torch.zeros(10, dtype=torch.bfloat16), "step": 0}
    tsckpt.load(sd, FIXTURE)
    assert np.array_equal(sd["w"].numpy(), _w()) and sd["step"] == 3
    assert torch.equal(sd["b"], torch.arange(10, dtype=torch.float32).bfloat16())
    assert tsckpt.verify(FIXTURE).ok


def test_version_2_partial_reads_check_the_whole_outer_chunk(tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(FIXTURE, path)
    edit_key(path, "w/c.0.0", lambda data: flip_byte(data, 4 * 16 * 16 * 9 + 5, 0x10))  # inner chunk 9 of 16
    ck = tsckpt.open(path)
    with pytest.raises(ChecksumError, match=r"'w'.*chunk \[0, 0\] does not match its stored crc32c"):
        ck["w"][0, 0]  # far from the flipped byte, in the same outer chunk
    np.testing.assert_array_equal(ck["b"].numpy().astype(np.float32), np.arange(10, dtype=np.float32))
    assert not tsckpt.verify(path).ok
