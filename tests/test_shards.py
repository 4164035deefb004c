"""Outer chunks encoded by tsckpt: TensorStore and zarr-python read them, and every box reads back checked."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr

import tsckpt  # noqa: F401  (registers bfloat16 with zarr-python)
from tsckpt.errors import ChecksumError
from tsckpt.format import checksums, shard_encoding, shards, zarr_json
from tsckpt.storage.box_reader import BoxReader
from tsckpt.storage.chunk_source import ChunkSource
from tsckpt.format.grid import ChunkGrid
from tsckpt.format.metadata import ArrayOptions, CheckpointMetadata, TensorEntry
from tsckpt.storage.store import Store

SHAPE = (10, 13)
CHUNK = (3, 16)  # rows cut by the saving ranks; columns rounded up to whole inner chunks
# Inner chunks across the array's edge and wholly outside it.
INNERS = [(1, 4), (1, 8), (3, 2)]
# Columns uncut, stored slowest; or cut too, stored by inner-chunk count (row-major for inner chunks of 3x2).
CHUNKS = [CHUNK, (3, 8)]


def _encode_region(fmt, shape, offsets, data):
    """Every outer chunk of a region written at ``offsets``, encoded: its grid index, its stored bytes, the flat
    indices of its inner chunks in the array's grid of inner chunks, and their crc32c values."""
    inner_grid = ChunkGrid(tuple(shape), fmt.inner).grid_shape
    for index, view in ChunkGrid(tuple(shape), fmt.chunk).chunks_within(offsets, data.shape):
        part = data[(*view, ...)]
        encoded, crcs = shard_encoding.encode(fmt, part)
        local = fmt.every if tuple(part.shape) == fmt.chunk else np.argwhere(fmt.present(part.shape))
        at = local + np.asarray(index, dtype=np.int64) * np.asarray(fmt.grid, dtype=np.int64)
        yield index, encoded, np.atleast_1d(np.ravel_multi_index(tuple(at.T), inner_grid)), crcs


def _data(dtype):
    rng = np.random.default_rng(0)
    return rng.standard_normal(SHAPE) > 0 if dtype is bool else rng.standard_normal(SHAPE).astype(dtype)


def _save(path, data, inner, crc32c_codec, chunk=CHUNK):
    """Write ``data`` in row blocks as ranks would, through the encoder; returns the entry and its codecs."""
    dtype = "bool" if data.dtype == bool else data.dtype.name
    entry = TensorEntry(("w",), "w", SHAPE, dtype, chunk, inner, None)
    options = ArrayOptions(crc32c_codec=crc32c_codec)
    fmt = shards.value_format(entry, options)
    kv = ts.KvStore.open({"driver": "file", "path": f"{path}/w/"}).result()
    kv.write("zarr.json", json.dumps(entry.zarr_json(options)).encode()).result()
    found = {}
    for row in range(0, SHAPE[0], chunk[0]):
        for index, encoded, pieces, crcs in _encode_region(fmt, SHAPE, (row, 0), data[row:row + chunk[0]]):
            assert len(encoded) == fmt.nbytes
            kv.write(zarr_json.chunk_key(index), encoded.tobytes()).result()
            found.update(zip(pieces.tolist(), crcs))
    # Each inner chunk's crc32c covers its elements inside the array, whatever the order it is stored in.
    units = ChunkGrid(SHAPE, inner)
    assert found == {units.flat_index(i): checksums.crc32c(data[view]) for i, view in units.chunks_within((0, 0), SHAPE)}
    return entry, options


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("crc32c_codec", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, bool])
@pytest.mark.parametrize("inner", INNERS)
def test_encoded_chunks_are_zarr_that_other_readers_read(tmp_path, inner, dtype, crc32c_codec, chunk):
    data = _data(dtype)
    _save(tmp_path, data, inner, crc32c_codec, chunk)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{tmp_path}/w/"}, "fill_missing_data_reads": False}
    np.testing.assert_array_equal(ts.open(spec).result().read().result(), data)
    np.testing.assert_array_equal(zarr.open_array(f"{tmp_path}/w", mode="r")[...], data)
    np.testing.assert_array_equal(zarr.open_array(f"{tmp_path}/w", mode="r")[4:9, 3:11], data[4:9, 3:11])


@pytest.mark.parametrize("inner", INNERS)
def test_every_box_reads_back_checked_and_damage_anywhere_in_its_pieces_is_refused(tmp_path, inner):
    data = _data(np.float32)
    entry, options = _save(tmp_path, data, inner, True)
    # A plain checkpoint: each inner chunk followed by its crc32c.
    md = CheckpointMetadata(world_size=1, tensors={"w": entry}, objects={}, array_options=options)
    source = ChunkSource.of(Store.open(tmp_path, layout="plain").for_checkpoint(md), md)
    reader = BoxReader(source, entry, "tensor 'w'")
    rng = np.random.default_rng(1)
    for _ in range(60):
        lo = [int(rng.integers(0, n)) for n in SHAPE]
        hi = [int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, SHAPE)]
        got = reader.read(lo, [b - a for a, b in zip(lo, hi)])
        np.testing.assert_array_equal(got, data[lo[0]:hi[0], lo[1]:hi[1]])
    # Flip one byte of the value at (4, 9); every box touching its inner chunk is refused, others are not.
    fmt = shards.value_format(entry, options)
    local = (4 - 3, 9)
    piece = fmt.positions[np.ravel_multi_index([x // u for x, u in zip(local, inner)], fmt.grid)]
    offset = int(piece) * fmt.piece_bytes + int(np.ravel_multi_index([x % u for x, u in zip(local, inner)], inner)) * 4
    with open(tmp_path / "w" / "c.1.0", "r+b") as f:
        f.seek(offset + 1)
        byte = f.read(1)
        f.seek(offset + 1)
        f.write(bytes([byte[0] ^ 0x08]))
    units = ChunkGrid(SHAPE, inner)
    damaged = units.chunks_overlapping([slice(4, 5), slice(9, 10)])[0]
    reader = BoxReader(source, entry, "tensor 'w'")
    for _ in range(120):
        lo = [int(rng.integers(0, n)) for n in SHAPE]
        hi = [int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, SHAPE)]
        box = [slice(a, b) for a, b in zip(lo, hi)]
        if damaged in units.chunks_overlapping(box):
            with pytest.raises(ChecksumError, match=r"'w'.*chunk \[1, 0\] does not match its stored crc32c"):
                reader.read(lo, [b - a for a, b in zip(lo, hi)])
        else:
            np.testing.assert_array_equal(reader.read(lo, [b - a for a, b in zip(lo, hi)]),
                                          data[lo[0]:hi[0], lo[1]:hi[1]])


def test_storage_order_puts_uncut_dimensions_first_then_the_dimension_with_most_inner_chunks_last():
    assert shards.ShardFormat((12565, 384), (1795, 16), 2).order == (0, 1)  # 7 x 24
    assert shards.ShardFormat((12565, 128), (359, 32), 2).order == (1, 0)  # 35 x 4
    # The columns of a row-sharded array's chunk come first, however many inner chunks each holds.
    row_sharded = TensorEntry(("w",), "w", (50257, 384), "float32", (12565, 384), (1795, 16), None)
    assert shards.uncut(row_sharded) == (1,) and shards.value_format(row_sharded, ArrayOptions()).order == (1, 0)
    assert shards.uncut(TensorEntry(("w",), "w", (70, 384), "float32", (70, 384), (7, 16), None)) == ()  # whole
    assert shards.ShardFormat((8, 6, 4), (2, 3, 1), 4, first=(1, 2)).order == (1, 2, 0)
    fmt = shards.ShardFormat((8, 6), (2, 3), 4)  # 4 x 2: column-major
    assert fmt.positions.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert fmt.coords(fmt.positions).tolist() == np.stack(np.unravel_index(np.arange(8), (4, 2)), axis=1).tolist()


def test_a_chunk_of_whole_rows_is_checked_in_one_pass_and_any_damaged_byte_fails_it():
    # Inner chunks of whole rows lie one after the other as the chunk's rows; a yes from intact() lets a whole
    # chunk be copied in one go, and a no sends it to the full check, which names the damage.
    fmt = shards.ShardFormat((6, 5), (2, 5), 4, crc32c_codec=True)
    data = np.arange(30, dtype=np.float32).reshape(6, 5)
    [(_, encoded, _, _)] = list(_encode_region(fmt, (6, 5), (0, 0), data))
    assert fmt.rows == (3, 2, 5) and fmt.intact(encoded)
    raw = 2 * 5 * 4
    values = encoded[:fmt.pieces * fmt.piece_bytes].reshape(fmt.pieces, fmt.piece_bytes)[:, :raw].view(np.float32)
    np.testing.assert_array_equal(values.reshape(fmt.rows), data.reshape(fmt.rows))
    for k in range(fmt.nbytes):  # a value, a checksum or the index
        damaged = encoded.copy()
        damaged[k] ^= 0x01
        assert not fmt.intact(damaged), k
    assert not shards.ShardFormat((6, 5), (2, 5), 4).intact(encoded)  # no codec checksums: the full check
    assert shards.ShardFormat((4, 6), (4, 3), 4).rows is None  # column blocks need untiling
    assert shards.ShardFormat((4, 6), (2, 3), 4).rows is None
    assert shards.ShardFormat((1, 6, 4), (1, 2, 4), 4).rows == (3, 1, 2, 4)
    assert shards.ShardFormat((2, 6, 4), (2, 2, 4), 4).rows is None  # rows of two planes interleave
    assert shards.ShardFormat((6, 4), (6, 4), 4, indexed=False).rows == (1, 6, 4)
