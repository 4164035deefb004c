"""Outer chunks encoded in parts: the same bytes and checksums whatever the part size, written and read as files."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
import torch

import tsckpt
from tsckpt.errors import ChecksumError
from tsckpt.format import shard_encoding
from tsckpt.format.shards import ShardFormat
from tsckpt.storage import byte_writes

# (chunk, inner, part inside the array): storage orders both ways, 1-D and 3-D, edges cut in every dimension.
CASES = [
    ((12, 16), (3, 4), (12, 16)),
    ((12, 16), (3, 4), (7, 13)),
    ((12, 16), (6, 2), (12, 9)),
    ((64,), (8,), (64,)),
    ((64,), (8,), (37,)),
    ((4, 6, 8), (2, 3, 2), (4, 6, 8)),
    ((4, 6, 8), (2, 3, 2), (3, 5, 7)),
    ((5, 7), (5, 7), (5, 7)),
    ((5, 7), (5, 7), (2, 7)),
]


def _data(shape, dtype):
    rng = np.random.default_rng(len(shape))
    if dtype is bool:
        return rng.standard_normal(shape) > 0
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("crc32c_codec", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, bool])
@pytest.mark.parametrize("chunk, inner, extent", CASES)
def test_every_unit_size_and_streaming_give_the_same_bytes_and_checksums(chunk, inner, extent, dtype, crc32c_codec):
    data = _data(extent, dtype)
    fmt = ShardFormat(chunk, inner, data.itemsize, crc32c_codec)
    reference, crcs = shard_encoding.encode(fmt, data, unit=1 << 40)  # one unit: the whole chunk at once
    assert shard_encoding.units(fmt, 1 << 40) == 1
    assert fmt.pieces == 1 or shard_encoding.units(fmt, 1) > 1  # the smallest target cuts it in parts
    for target in (1, fmt.piece_bytes, 3 * fmt.piece_bytes, 1 << 40):
        encoded, again = shard_encoding.encode(fmt, data, unit=target)
        np.testing.assert_array_equal(encoded, reference)
        assert again == crcs
        parts: list[bytes] = []
        with byte_writes.scratch() as get:
            streamed = shard_encoding.encode_to(fmt, data, lambda b: parts.append(bytes(b)), get, unit=target)
        assert b"".join(parts) == reference.tobytes()
        assert streamed == crcs


def test_a_chunk_file_that_exists_is_replaced_never_written_into(tmp_path):
    fmt = ShardFormat((8,), (4,), 4)
    data = np.arange(8, dtype=np.float32)
    base = tmp_path / "base"
    base.write_bytes(b"the base checkpoint's chunk")
    target = tmp_path / "new" / "c" / "0"
    target.parent.mkdir(parents=True)
    os.link(base, target)  # as an incremental save's reused chunk would be
    writer = byte_writes.Files(str(tmp_path), sync=True, threads=1)
    writer.write("new/c/0", shard_encoding.EncodedChunk(fmt, data))
    writer.finish()
    assert base.read_bytes() == b"the base checkpoint's chunk"
    assert target.read_bytes() == shard_encoding.encode(fmt, data)[0].tobytes()
    assert os.stat(target).st_nlink == 1


@pytest.fixture(params=["streamed", "whole"])
def streamed(request, monkeypatch):
    """Chunk files written on the write threads and read unit by unit, or written inline and read whole."""
    monkeypatch.setattr(byte_writes, "INLINE_BYTES", 0 if request.param == "streamed" else 1 << 40)
    return request.param


def _save_in_units(tmp_path, monkeypatch):
    """A checkpoint whose chunk files hold several units each (small units), and the tensor saved."""
    monkeypatch.setattr(shard_encoding, "UNIT_BYTES", 1024)
    weight = torch.randn(64, 96)
    path = tmp_path / "ck"
    # Plain: these tests read and edit its chunk files (whatever TSCKPT_LAYOUT says).
    tsckpt.save({"w": weight}, path, inner_chunk_bytes=256, layout="plain")  # inner chunks of 64 values: 24 per 1 KiB unit
    entry = tsckpt.open(path)["w"]
    fmt = ShardFormat(entry.chunks.chunk_shape, entry.chunks.inner_chunk_shape, 4)
    assert shard_encoding.units(fmt) > 1
    return path, weight


def test_chunk_files_written_and_read_in_units_load_bit_exact(tmp_path, monkeypatch, streamed):
    path, weight = _save_in_units(tmp_path, monkeypatch)
    sd = {"w": torch.zeros(64, 96)}
    tsckpt.load(sd, path)
    assert torch.equal(sd["w"], weight)
    assert torch.equal(torch.as_tensor(tsckpt.open(path)["w"][5:40, 7:90]), weight[5:40, 7:90])


def test_damage_in_a_later_unit_of_a_chunk_file_fails_the_whole_read(tmp_path, monkeypatch, streamed):
    path, _ = _save_in_units(tmp_path, monkeypatch)
    chunk = next(p for p in (path / "w").rglob("*") if p.is_file() and p.name != "zarr.json")
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) - 3 * 1024] ^= 0x10  # inside the data, a few units from the start
    chunk.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="'w'"):
        tsckpt.load({"w": torch.zeros(64, 96)}, path)


def test_a_truncated_chunk_file_is_refused_naming_its_size(tmp_path, monkeypatch, streamed):
    path, _ = _save_in_units(tmp_path, monkeypatch)
    chunk = next(p for p in (path / "w").rglob("*") if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(chunk.read_bytes()[:-100])
    with pytest.raises(tsckpt.TsckptError, match="truncated or replaced"):
        tsckpt.load({"w": torch.zeros(64, 96)}, path)


# (array shape, chunk shape): 0-d, and chunks cut at the array's edge.
LEAF_CASES = [((), ()), ((37,), (16,)), ((7, 13), (4, 5))]


@pytest.mark.parametrize("crc32c_codec", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bool"])
@pytest.mark.parametrize("shape, chunk", LEAF_CASES)
def test_chunks_without_inner_chunks_are_the_bytes_tensorstore_writes(tmp_path, shape, chunk, dtype, crc32c_codec):
    """tsckpt writes the chunk files of arrays without inner chunks itself: byte for byte what TensorStore's
    codecs (``bytes``, then ``crc32c`` with the codec) store, edge chunks padded as Zarr pads them."""
    import tensorstore as ts

    from tsckpt.format import dtypes, zarr_json
    from tsckpt.format.grid import ChunkGrid

    dt = dtypes.from_zarr(dtype)
    data = _data(shape, bool if dtype == "bool" else dt.numpy)
    doc = zarr_json.array_metadata(shape, dt.zarr, chunk, checksums=crc32c_codec)
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path)}, "metadata": doc,
                   "create": True, "store_data_equal_to_fill_value": True}).result()
    arr.write(data).result()
    fmt = ShardFormat(chunk, chunk, dt.itemsize, crc32c_codec, indexed=False)
    assert fmt.index_bytes == 0 and fmt.pieces == 1
    for index, view in ChunkGrid(shape, chunk).chunks_within((0,) * len(shape), shape):
        encoded, _ = shard_encoding.encode(fmt, data[(*view, ...)])
        with open(tmp_path / zarr_json.chunk_key(index), "rb") as f:
            assert f.read() == encoded.tobytes(), index
