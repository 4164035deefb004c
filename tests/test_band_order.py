"""Where a rank's values go in its data file: on object stores the bands of all its tensors band by band, so
that a column block of a row-sharded save is one byte range per file (tsckpt/format/band_order.py); on a local
disk each tensor's values in one piece, in the order of the save."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

import tsckpt
from dist import run_ranks
from tsckpt.format import band_order, zarr_json
from tsckpt.format.grid import ChunkGrid

WORLD = 2
BUCKET = "tsckpt-placement"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)
#: 2-D tensors of three widths (so of different band widths) and a 1-d one, each row-sharded.
SHAPES = {"a": ((256, 512), torch.float32), "b": ((128, 1024), torch.bfloat16), "c": ((64, 384), torch.float32),
          "bias": ((512,), torch.float32)}


def _state(mesh, column: bool, fill: bool) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    for k, (name, (shape, dtype)) in enumerate(SHAPES.items()):
        g = torch.Generator().manual_seed(k)
        full = torch.randn(shape, generator=g).to(dtype) if fill else torch.zeros(shape, dtype=dtype)
        out[name] = distribute_tensor(full, mesh, [Shard(1 if column and len(shape) > 1 else 0)], src_data_rank=None)
    return out


def _save_then_load_columns(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    dcp.save(_state(mesh, column=False, fill=True), storage_writer=tsckpt.TensorStoreWriter(path, layout="packed"))
    dest = _state(mesh, column=True, fill=False)
    dcp.load(dest, storage_reader=tsckpt.TensorStoreReader(path))
    want = _state(mesh, column=True, fill=True)
    return all(torch.equal(dest[k].to_local(), want[k].to_local()) for k in SHAPES)


def _values(path: str) -> dict[str, list[tuple[int, str, tuple[int, ...], ChunkGrid]]]:
    """Per data file, every value it holds: (offset, tensor, chunk index, grid), in file order."""
    ck = tsckpt.open(path)
    source = ck.source
    by_file: dict[str, list] = {}
    for name, entry in ck.metadata.tensors.items():
        grid = entry.grid
        for index in grid.indices():
            found = source.locator.locate(f"{entry.path}/{zarr_json.chunk_key(index)}")
            assert found is not None and found.file, (name, index)
            by_file.setdefault(found.file, []).append((found.offset, name, index, grid))
    return {f: sorted(v) for f, v in by_file.items()}


def test_on_an_object_store_a_column_block_of_a_row_sharded_save_is_one_range_per_file(s3):
    path = s3.location(BUCKET, "ck")
    assert run_ranks(WORLD, _save_then_load_columns, path) == [True] * WORLD
    files = _values(path)
    assert len(files) == WORLD
    for values in files.values():
        # 1-d values first, then the 2-d ones by where their band starts along the columns.
        ndims = [len(grid.shape) for _, _, _, grid in values]
        assert ndims == sorted(ndims)
        starts = [index[1] * grid.chunk_shape[1] / grid.shape[1] for _, _, index, grid in values if len(grid.shape) > 1]
        assert starts == sorted(starts) and len(set(starts)) > 1
        # The tensors' values interleave rather than each lying in one piece.
        names = [name for _, name, _, grid in values if len(grid.shape) > 1]
        assert any(names.index(n) + names.count(n) - 1 != len(names) - 1 - names[::-1].index(n) for n in set(names))
        # Columns [1/4, 1/2) of every 2-d tensor: values that lie next to each other in the file.
        block = [k for k, (_, _, index, grid) in enumerate(values) if len(grid.shape) > 1
                 and index[1] * grid.chunk_shape[1] < grid.shape[1] // 2
                 and (index[1] + 1) * grid.chunk_shape[1] > grid.shape[1] // 4]
        assert block == list(range(block[0], block[-1] + 1))


def test_on_a_local_disk_each_tensor_lies_in_one_piece_in_the_order_of_the_save(tmp_path):
    path = str(tmp_path / "ck")
    assert run_ranks(WORLD, _save_then_load_columns, path) == [True] * WORLD
    files = _values(path)
    assert len(files) == WORLD
    for values in files.values():
        names = [name for _, name, _, _ in values]
        assert names == [n for n in SHAPES for _ in range(names.count(n))]  # a same-topology load reads in order
        assert all(grid.grid_shape[1:] == (1,) * (len(grid.shape) - 1) for _, _, _, grid in values)  # no bands


def test_sort_key_puts_scalars_then_values_spanning_every_column_first_then_bands_by_fraction():
    wide, narrow = ChunkGrid((8, 400), (4, 100)), ChunkGrid((8, 40), (4, 20))
    keys = sorted([(band_order.sort_key(wide, (r, c), 0), ("wide", r, c)) for r in range(2) for c in range(4)]
                  + [(band_order.sort_key(narrow, (r, c), 1), ("narrow", r, c)) for r in range(2) for c in range(2)]
                  + [(band_order.sort_key(ChunkGrid((8,), (4,)), (r,), 2), ("bias", r)) for r in range(2)]
                  + [(band_order.sort_key(ChunkGrid((8, 24), (4, 24)), (r, 0), 3), ("unbanded", r)) for r in range(2)]
                  + [(band_order.sort_key(ChunkGrid((), ()), (), 4), ("step",))])
    order = [what for _, what in keys][1:]
    # Scalars first; then chunks spanning every column, which hold a piece of each column block: together,
    # ahead of the bands.
    assert keys[0][1] == ("step",)
    assert order[:4] == [("bias", 0), ("bias", 1), ("unbanded", 0), ("unbanded", 1)]
    keys = keys[1:]
    # Bands at 0, 1/4, 1/2, 3/4 of the wide tensor's columns and 0, 1/2 of the narrow one's, then rows.
    assert order[4:] == [("wide", 0, 0), ("narrow", 0, 0), ("wide", 1, 0), ("narrow", 1, 0), ("wide", 0, 1),
                         ("wide", 1, 1), ("wide", 0, 2), ("narrow", 0, 1), ("wide", 1, 2), ("narrow", 1, 1),
                         ("wide", 0, 3), ("wide", 1, 3)]
    assert np.all(np.diff([k[1] for k, _ in keys[4:]]) >= 0)


def test_replicas_cut_rows_first_then_bands_and_never_a_tensor_stored_as_one_value():
    assert band_order.stripe_dims(ChunkGrid((8, 400), (2, 100))) == (0, 1)  # row-sharded, in bands
    assert band_order.stripe_dims(ChunkGrid((8, 400), (2, 400))) == (0,)  # row-sharded, no bands
    assert band_order.stripe_dims(ChunkGrid((8, 400), (8, 100))) == (1,)  # column-sharded
    assert band_order.stripe_dims(ChunkGrid((1000,), (250,))) == (0,)
    assert band_order.stripe_dims(ChunkGrid((8, 400), (8, 400))) == ()
