"""The packed layout's building blocks: per-rank OCDBT databases, the join, the commit, and reading back."""

from __future__ import annotations

import os
from dataclasses import replace as dataclasses_replace
import re

import dask.array as da
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch.distributed as dist
import zarr

import packed_build as pb
from dist import run_ranks
from tsckpt.format import commit as hierarchy
from tsckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError, TsckptError
from tsckpt.location import encode_json, make_context, open_kvstore, parse_location
from tsckpt.packed import PackedLayout, PackedOptions, is_packed, reader_context
from tsckpt.zarr_kvstore import zarr_store

WORLD = 3
_FILE = re.compile(r"^(zarr\.json|manifest\.ocdbt|d/[0-9a-f]{32}|ocdbt\.process_\d+/d/[0-9a-f]{32})$")


def zoo() -> list[pb.Tensor]:
    """Tensors that exercise the layout: several dtypes, 0-d, fewer rows than ranks, nested groups."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 16, size=(96, 160), dtype=np.uint16)
    return [
        pb.Tensor(("model", "embed.weight"), bits.view(ml_dtypes.bfloat16), "bfloat16"),
        pb.Tensor(("model", "layers", "0", "w"), rng.standard_normal((50, 33)).astype(np.float32), "float32"),
        pb.Tensor(("model", "norm"), rng.standard_normal(7).astype(np.float16), "float16"),
        pb.Tensor(("model", "tiny"), rng.integers(-9, 9, size=(2, 3), dtype=np.int8), "int8"),  # rank 2 has no rows
        pb.Tensor(("optim", "step"), np.array(12.5, dtype=np.float32), "float32"),
    ]


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def read_all_through_tensorstore(location, tensors) -> None:
    loc = parse_location(location)
    context = reader_context(make_context(location=loc))
    for t in tensors:
        arr = ts.open(PackedLayout().read_spec(dict(loc.spec), t.path), context=context).result()
        assert same(arr.read().result(), t.data), t.path


def read_all_through_zarr(store, tensors) -> None:
    group = zarr.open_group(store)  # default mode "a": must still work on the read-only checkpoint
    for t in tensors:
        assert same(np.asarray(group[t.path][...]), t.data), t.path


def test_joined_checkpoint_reads_back_bit_exactly_through_tensorstore_zarr_and_dask(tmp_path):
    tensors = zoo()
    path = str(tmp_path / "ck")
    pb.save(path, tensors, WORLD, layout="packed")

    read_all_through_tensorstore(path, tensors)
    store = zarr_store(path)
    assert store.layout == "packed"
    read_all_through_zarr(store, tensors)
    group = zarr.open_group(store, mode="r")
    assert sorted(group.keys()) == ["model", "optim"] and sorted(group["model"].keys()) == [
        "embed.weight", "layers", "norm", "tiny"]
    assert group.attrs["tsckpt"]["tensors"]["model.embed.weight"]["shape"] == [96, 160]
    embed = da.from_zarr(store, component="model/embed.weight")
    assert embed.chunksize == (32, 160)  # one chunk per rank, as the plain layout
    assert same(np.asarray(embed.compute()), tensors[0].data)
    assert same(np.asarray(da.from_zarr(store, component="model/layers/0/w")[10:40, 5:20].compute()),
                tensors[1].data[10:40, 5:20])


def test_packed_files_are_one_database_per_rank_and_the_join_copies_no_data(tmp_path):
    tensors = zoo()
    path = str(tmp_path / "ck")
    pb.save(path, tensors, WORLD, layout="packed")
    files = pb.files(path)
    assert all(_FILE.match(f) for f in files), files
    ranks_with_rows = {r for r in range(WORLD) for t in tensors if t.rank_nbytes(r, WORLD)}
    for rank in range(WORLD):
        mine = [f for f in files if f.startswith(f"ocdbt.process_{rank}/")]
        # all of the rank's writes are one commit under the target size: one data file (its manifest is
        # deleted once joined: the root database refers to the data files only)
        assert len(mine) == (1 if rank in ranks_with_rows else 0), mine
    root_data = [f for f in files if f.startswith("d/")]
    assert "manifest.ocdbt" in files and "zarr.json" in files and 1 <= len(root_data) <= 2
    nbytes = sum(t.data.nbytes for t in tensors)
    root_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in root_data)
    rank_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in files if f.startswith("ocdbt.process_"))
    assert rank_bytes >= nbytes  # the chunks themselves live in the ranks' data files ...
    assert root_bytes < nbytes / 10  # ... and the root database only refers to them
    target = PackedOptions().target_data_file_size
    per_rank = max(sum(t.rank_nbytes(r, WORLD) for t in tensors) for r in range(WORLD))
    # the bound: ranks x (1 + bytes per rank / target) + the root's manifest, B+tree file and zarr.json
    assert len(files) <= len(ranks_with_rows) * (1 + per_rank / target) + 3


def test_small_target_file_size_splits_a_rank_into_bounded_files(tmp_path):
    rng = np.random.default_rng(1)
    tensors = [pb.Tensor(("w", str(i)), rng.standard_normal((64, 256)).astype(np.float32), "float32")
               for i in range(12)]  # 64 KiB chunks, 768 KiB per rank at one rank
    path = str(tmp_path / "ck")
    options = PackedOptions(target_data_file_size=256 << 10)
    pb.prepare(path, layout="packed")
    pb.write_rank(path, tensors, 0, 1, layout="packed", transaction=True, options=options)
    pb.commit(path, tensors, 1, layout="packed", options=options)
    data = [f for f in pb.files(path) if f.startswith("ocdbt.process_0/d/")]
    sizes = [os.path.getsize(os.path.join(path, f)) for f in data]
    # a file closes at the first chunk that reaches the target, so none exceeds it by more than a chunk
    assert 3 <= len(data) <= 4 and max(sizes) <= (256 << 10) + (64 << 10) + 4096, sizes
    read_all_through_zarr(zarr_store(path), tensors)


def test_uncommitted_packed_location_is_not_a_checkpoint(tmp_path):
    tensors = zoo()
    path = str(tmp_path / "ck")
    loc = parse_location(path)
    kv = open_kvstore(loc, make_context(location=loc))
    with pytest.raises(CheckpointNotFoundError):
        zarr_store(path)
    pb.prepare(path, layout="packed")
    for rank in range(WORLD):
        pb.write_rank(path, tensors, rank, WORLD, layout="packed", transaction=True)
    # Ranks wrote, nothing joined: no root document, no root database.
    for check in (lambda: zarr_store(path), lambda: hierarchy.read_metadata(kv, path)):
        with pytest.raises(IncompleteCheckpointError, match="did not finish"):
            check()
    assert not is_packed(kv)

    # Joined and every array document written, but the coordinator died before the root document.
    nodes, flush = PackedLayout().join(dict(loc.spec), WORLD, make_context(location=loc))
    for t in tensors:
        nodes.write(f"{t.path}/zarr.json", encode_json(t.zarr_metadata(WORLD))).result()
    flush()
    assert is_packed(kv)
    with pytest.raises(IncompleteCheckpointError, match="did not finish"):
        zarr_store(path)
    with pytest.raises(FileNotFoundError):
        zarr.open_group(zarr_store(path, allow_incomplete=True), mode="r")

    pb.commit(path, tensors, WORLD, layout="packed")  # the same save finishing: now it is one
    read_all_through_zarr(zarr_store(path), tensors)


def test_prepare_clears_what_a_dead_packed_save_left(tmp_path):
    rng = np.random.default_rng(3)
    old = [pb.Tensor(("old",), rng.standard_normal((6, 4)).astype(np.float32), "float32")]
    new = [pb.Tensor(("new",), rng.standard_normal((6, 4)).astype(np.float32), "float32")]
    path = str(tmp_path / "ck")
    for rank in range(2):  # a save that died after writing its data
        pb.write_rank(path, old, rank, 2, layout="packed")

    pb.save(path, new, 2, layout="packed")
    listed = _list_keys(zarr_store(path))
    assert not [k for k in listed if k.startswith("old/")], listed
    assert [k for k in listed if k.startswith("new/")] == ["new/c.0.0", "new/c.1.0", "new/zarr.json"]

    # Without the prepare step the stale chunks would have been joined in.
    stale = str(tmp_path / "stale")
    for rank in range(2):
        pb.write_rank(stale, old, rank, 2, layout="packed")
    for rank in range(2):
        pb.write_rank(stale, new, rank, 2, layout="packed")
    pb.commit(stale, new, 2, layout="packed")
    assert [k for k in _list_keys(zarr_store(stale)) if k.startswith("old/")] == ["old/c.0.0", "old/c.1.0"]


def test_damaged_root_database_fails_cleanly_naming_the_checksum(tmp_path):
    tensors = zoo()
    path = str(tmp_path / "ck")
    pb.save(path, tensors, WORLD, layout="packed")
    manifest = tmp_path / "ck" / "manifest.ocdbt"
    damaged = bytearray(manifest.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    manifest.write_bytes(bytes(damaged))
    with pytest.raises(TsckptError, match="checksum"):
        zarr.open_group(zarr_store(path), mode="r")["model/embed.weight"][...]
    with pytest.raises(ValueError, match="checksum"):
        read_all_through_tensorstore(path, tensors)


def _list_keys(store) -> list[str]:
    return zarr.core.sync.sync(_collect(store.list()))


async def _collect(it) -> list[str]:
    return [k async for k in it]


def test_options_are_checked_and_round_trip():
    opts = PackedOptions(target_data_file_size=1 << 20, max_inline_value_bytes=64, compress_nodes=False)
    assert PackedOptions.from_dict(opts.to_dict()) == opts
    assert opts.ocdbt_config()["compression"] is None
    with pytest.raises(TsckptError, match="target_data_file_size"):
        PackedOptions(target_data_file_size=-1)
    with pytest.raises(TsckptError, match="unknown packed layout options"):
        PackedOptions.from_dict({"target_file_size": 1})
    with pytest.raises(TsckptError, match="rank must be"):
        PackedLayout().rank_database({"driver": "memory", "path": "x/"}, -1)


def test_memory_location_packed_checkpoint():
    tensors = zoo()
    location = "memory://packed-test/ck"
    pb.save(location, tensors, WORLD, layout="packed")
    read_all_through_tensorstore(location, tensors)
    read_all_through_zarr(zarr_store(location), tensors)


# --- real ranks ---------------------------------------------------------------


def _rank_saves(rank: int, world: int, path: str) -> int:
    tensors = zoo()
    if rank == 0:
        pb.prepare(path, layout="packed")
    dist.barrier()  # nobody writes before stale state is gone
    written = pb.write_rank(path, tensors, rank, world, layout="packed", transaction=True)
    dist.barrier()  # every rank's database is durable before the coordinator joins them
    if rank == 0:
        pb.commit(path, tensors, world, layout="packed")
    return written


def test_spawned_gloo_ranks_write_their_own_databases_and_the_coordinator_joins_them(tmp_path):
    path = str(tmp_path / "ck")
    written = run_ranks(WORLD, _rank_saves, path)
    tensors = zoo()
    assert sum(written) == sum(t.data.nbytes for t in tensors)
    assert {f.split("/")[0] for f in pb.files(path) if f.startswith("ocdbt.")} == {
        f"ocdbt.process_{r}" for r in range(WORLD)}
    read_all_through_tensorstore(path, tensors)
    read_all_through_zarr(zarr_store(path), tensors)
    assert same(np.asarray(da.from_zarr(zarr_store(path), component="model/embed.weight").compute()),
                tensors[0].data)


def test_root_document_names_its_layout_and_an_unknown_one_is_refused():
    from tsckpt.errors import MetadataError
    from tsckpt.format.metadata import CheckpointMetadata
    from tsckpt.format.spec import layout_for

    md = CheckpointMetadata(world_size=1, tensors={}, objects={}, layout="packed")
    assert md.to_dict()["layout"] == "packed"
    assert layout_for(CheckpointMetadata.from_dict(md.to_dict())).name == "packed"
    assert "layout" not in dataclasses_replace(md, layout="plain").to_dict()  # plain documents are unchanged
    with pytest.raises(MetadataError, match="unknown storage layout 'flat'"):
        layout_for(CheckpointMetadata.from_dict(md.to_dict() | {"layout": "flat"}))
    with pytest.raises(MetadataError, match="'layout' must be a string"):
        CheckpointMetadata.from_dict(md.to_dict() | {"layout": 3})
