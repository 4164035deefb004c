"""A checkpoint written in format version 4 (inner chunks stored by count alone) still loads, checked.

``data/format-v4`` was written by ``dcp.save`` with tsckpt's ``TensorStoreWriter`` at
format version 4 (packed layout, ``inner_chunk_bytes=256``) from 2 gloo ranks:
``w`` is an 8x512 float32 DTensor sharded on dim 0 (chunks of 4x512, cut into
1x64 inner chunks: a grid of 4x8, stored row by row), ``b`` ten replicated
bfloat16 values, ``step`` the integer 3. Version 5 stores such a chunk column
block by column block, so a reader that took the order from the wrong version
would place every inner chunk but the first of each row elsewhere.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import dist
import tsckpt
from damage import edit_key, flip_byte, read_key
from tsckpt.errors import ChecksumError
from tsckpt.format import shards
from tsckpt.format.versions import FORMAT_VERSION

FIXTURE = Path(__file__).parent / "data" / "format-v4"
TIMEOUT = 120


def _w() -> np.ndarray:
    return (torch.arange(8 * 512, dtype=torch.float32).reshape(8, 512) / 7).numpy()


def test_version_4_loads_slices_verifies_and_reads_through_zarr():
    ck = tsckpt.open(FIXTURE)
    assert ck.metadata.version == 4 and ck["w"].chunks.inner_chunk_shape == (1, 64)
    np.testing.assert_array_equal(ck["w"].numpy(), _w())
    for box in [(slice(None), slice(128, 256)), (slice(1, 7), slice(60, 200)), (slice(3, 5), slice(None))]:
        np.testing.assert_array_equal(ck["w"][box].numpy(), _w()[box])
    sd = {"w": torch.zeros(8, 512), "b": torch.zeros(10, dtype=torch.bfloat16), "step": 0}
    tsckpt.load(sd, FIXTURE)
    assert np.array_equal(sd["w"].numpy(), _w()) and sd["step"] == 3
    assert torch.equal(sd["b"], torch.arange(10, dtype=torch.float32).bfloat16())
    assert tsckpt.verify(FIXTURE).ok
    w = zarr.open_group(tsckpt.zarr_store(FIXTURE), mode="r")["w"]
    np.testing.assert_array_equal(w[:, 100:300], _w()[:, 100:300])


def test_version_4_damage_is_found_at_the_inner_chunk_its_order_puts_there(tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(FIXTURE, path)
    fmt = shards.ShardFormat((4, 512), (1, 64), 4, crc32c_codec=True)
    assert fmt.order == (0, 1)
    # The second stored inner chunk of chunk [1, 0] is, in version 4's order, row 0 of the chunk, columns 64-128.
    edit_key(path, "w/c.1.0", lambda data: flip_byte(data, fmt.piece_bytes + 8, 0x10))
    ck = tsckpt.open(path)
    np.testing.assert_array_equal(ck["w"][5:8, :].numpy(), _w()[5:8, :])
    np.testing.assert_array_equal(ck["w"][4:5, 128:].numpy(), _w()[4:5, 128:])
    with pytest.raises(ChecksumError, match=r"'w'.*chunk \[1, 0\] does not match its stored crc32c at inner "
                                            r"chunk \[0, 1\]"):
        ck["w"][4, 70]


def _save_on(rank: int, world: int, base: str, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(torch.from_numpy(_w()), mesh, [Shard(0)]),
          "b": distribute_tensor(torch.arange(10, dtype=torch.float32).bfloat16(), mesh, [Replicate()]), "step": 3}
    dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(path, inner_chunk_bytes=256, base=base, layout="packed"))


def test_a_save_on_a_version_4_base_stores_uncut_dimensions_first_and_takes_only_chunks_stored_alike(tmp_path):
    base, new = tmp_path / "base", tmp_path / "new"
    shutil.copytree(FIXTURE, base)
    dist.run_ranks(2, _save_on, str(base), str(new), timeout=TIMEOUT)
    ck = tsckpt.open(new)
    old = tsckpt.open(base).metadata.tensors["w"]
    entry = ck.metadata.tensors["w"]
    assert ck.metadata.version == FORMAT_VERSION == 5 and not old.uncut_first
    assert (entry.chunk_shape, entry.inner_chunk_shape) == (old.chunk_shape, old.inner_chunk_shape)
    # Same chunks, another order: w is written afresh; only b's one chunk (stored alike) is taken.
    assert ck.metadata.reuse is not None and ck.metadata.reuse.chunks_reused == 1
    assert ck.metadata.reuse.bytes_reused == 20
    assert tsckpt.verify(new).ok and np.array_equal(ck["w"].numpy(), _w())
    # Version 5's order, in the bytes: the second stored inner chunk is row 1's first column block,
    # where version 4 stored row 0's second.
    fmt = shards.shard_format(entry, ck.metadata.array_options)
    assert fmt.order == (1, 0)
    for path, row, cols in [(new, 1, slice(0, 64)), (base, 0, slice(64, 128))]:
        stored = np.frombuffer(read_key(path, "w/c.0.0"), np.uint8)
        np.testing.assert_array_equal(stored[fmt.piece_bytes:fmt.piece_bytes + 256].view("<f4"), _w()[row, cols])
