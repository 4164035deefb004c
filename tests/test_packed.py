"""The packed layout through the public API: per-rank OCDBT databases joined at commit, read by every path."""

from __future__ import annotations

import os
import re

import dask.array as da
import numpy as np
import pytest
import tensorstore as ts
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import zarr

import tsckpt
from damage import layout_of, packed_values
from dist import run_ranks
from tsckpt.errors import (
    ChecksumError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    MetadataError,
    TsckptError,
)
from tsckpt.storage.layouts import layout_for
from tsckpt.format.data_files import DataFiles, RankFiles
from tsckpt.format.metadata import ArrayOptions, CheckpointMetadata
from tsckpt.storage import packed
from tsckpt.storage.location import parse_location

#: Every file a packed checkpoint may hold (docs/format.md): the root document, the manifest, the index and a
#: data file per rank (in parts on object stores).
PACKED_FILE = re.compile(r"^(zarr\.json|manifest\.ocdbt|d/[0-9a-f]{32}\.index|d/[0-9a-f]{32}-\d+(\.\d+)?)$")


def files(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def state(seed: int = 0) -> dict:
    """Several dtypes, a 0-d tensor, an empty one, a 1-d one, plain values and a pickled one."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"embed": torch.randn(97, 40, generator=g).to(torch.bfloat16),
                  "w": torch.randn(50, 33, generator=g),
                  "norm": torch.randn(7, generator=g).half(),
                  "empty": torch.zeros(0, 4),
                  "ids": torch.randint(-9, 9, (3, 5), generator=g, dtype=torch.int8)},
        "optim": {"step": torch.tensor(12.5), "lr": 1e-3, "name": "adamw"},
        "blob": {1, 2, 3},  # not JSON: a torch.save blob in an array
        "seed": seed,
    }


def zeros_like(sd: dict) -> dict:
    return {k: zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) if torch.is_tensor(v) else None
            for k, v in sd.items()}


def assert_same(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, dict):
            assert_same(got[k], v)
        elif torch.is_tensor(v):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_packed_save_is_few_files_and_every_reader_gets_the_same_bits(tmp_path):
    sd, path = state(), str(tmp_path / "ck")
    tsckpt.save(sd, path, layout="packed")
    found = files(path)
    assert all(PACKED_FILE.match(f) for f in found), found
    # the root document, the manifest, the index and one data file of rank 0
    assert len(found) == 4 and "manifest.ocdbt" in found

    out = zeros_like(sd)
    tsckpt.load(out, path)
    assert_same(out, sd)
    ck = tsckpt.open(path)
    assert ck.metadata.layout == "packed"
    assert ck["model.w"].writers() == {(0, 0): 0}  # read from the rank's digest table
    np.testing.assert_array_equal(ck["model.w"].numpy()[10:20, 3:9], sd["model"]["w"].numpy()[10:20, 3:9])
    group = zarr.open_group(tsckpt.zarr_store(path), mode="r")
    np.testing.assert_array_equal(group["model/w"][...], sd["model"]["w"].numpy())
    assert group["model/ids"].dtype == np.int8 and group["model/empty"].shape == (0, 4)
    assert group.attrs["tsckpt"]["layout"] == "packed"
    lazy = da.from_zarr(tsckpt.zarr_store(path), component="model/w")
    np.testing.assert_array_equal(lazy[5:45, 1:30].compute(), sd["model"]["w"].numpy()[5:45, 1:30])
    report = tsckpt.verify(path)
    assert report.ok and report.checksummed > 0


def test_packed_and_plain_overwrite_each_other_and_nothing_of_the_old_layout_stays(tmp_path):
    path = str(tmp_path / "ck")
    tsckpt.save(state(1), path, layout="plain")
    assert os.path.isdir(os.path.join(path, "model", "w"))
    tsckpt.save(state(2), path, layout="packed", overwrite=True)
    assert all(PACKED_FILE.match(f) for f in files(path)) and not tsckpt.leftovers(path)
    out = zeros_like(state(2))
    tsckpt.load(out, path)
    assert_same(out, state(2))
    tsckpt.save(state(3), path, overwrite=True, layout="plain")
    assert not [f for f in files(path) if "ocdbt" in f or PACKED_FILE.match(f) and f != "zarr.json"]
    tsckpt.load(out, path)
    assert_same(out, state(3))


class _DiesBeforeCommit(tsckpt.TensorStoreWriter):
    """A writer whose coordinator fails after every rank's data is durable, before the commit."""

    def finish(self, metadata, results):
        raise RuntimeError("coordinator died before the commit")


def test_a_packed_save_that_dies_before_its_commit_changes_nothing(tmp_path):
    path = str(tmp_path / "ck")
    tsckpt.save(state(1), path, layout="packed")
    with pytest.raises(BaseException, match="coordinator died"):
        dcp.save(state(2), storage_writer=_DiesBeforeCommit(path, layout="packed"))
    out = zeros_like(state(1))
    tsckpt.load(out, path)
    assert_same(out, state(1))


def test_in_place_packed_save_that_died_is_incomplete_and_the_next_save_clears_it():
    location = "memory://packed-tests/died"
    with pytest.raises(BaseException, match="coordinator died"):
        dcp.save({"old": torch.ones(6, 4)}, storage_writer=_DiesBeforeCommit(location, layout="packed"))
    with pytest.raises(IncompleteCheckpointError, match="did not finish"):
        tsckpt.zarr_store(location)
    with pytest.raises(IncompleteCheckpointError):
        tsckpt.load({"old": torch.zeros(6, 4)}, location)
    # Its claim says a save may still be running; cleaned with force, its claim and data files go, and the
    # next save needs no overwrite=True.
    assert [c.what for c in tsckpt.clean(location, force=True)][0].startswith("claim of save")
    tsckpt.save({"new": torch.full((6, 4), 2.0)}, location, layout="packed")
    group = zarr.open_group(tsckpt.zarr_store(location), mode="r")
    assert sorted(group.array_keys()) == ["new"]  # nothing of the dead save's data is indexed
    np.testing.assert_array_equal(group["new"][...], np.full((6, 4), 2.0, np.float32))


def test_empty_location_is_not_found_through_zarr_store(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        tsckpt.zarr_store(str(tmp_path / "nothing"))


def _flip_middle_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_flipped_byte_in_a_rank_data_file_is_caught_by_load_and_verify(tmp_path):
    sd, path = {"w": torch.randn(256, 64)}, str(tmp_path / "ck")
    tsckpt.save(sd, path, layout="packed")
    data = [f for f in files(path) if re.match(r"d/[0-9a-f]{32}-0$", f)]
    assert len(data) == 1
    _flip_middle_byte(os.path.join(path, data[0]))
    with pytest.raises(ChecksumError, match="'w'"):
        tsckpt.load({"w": torch.zeros(256, 64)}, path)
    report = tsckpt.verify(path)
    assert [e.key for e in report.failed] == ["w"]


def test_a_damaged_manifest_fails_tensorstore_readers_and_verify_but_not_tsckpts_reads(tmp_path):
    """The manifest is how TensorStore finds the index; tsckpt finds it through the root document."""
    path = str(tmp_path / "ck")
    tsckpt.save(state(), path, layout="packed")
    _flip_middle_byte(os.path.join(path, "manifest.ocdbt"))
    with pytest.raises(TsckptError, match="checksum|damaged"):
        zarr.open_group(tsckpt.zarr_store(path), mode="r")["model/w"][...]
    out = zeros_like(state())
    tsckpt.load(out, path)
    assert_same(out, state())
    report = tsckpt.verify(path)
    assert not report.ok and "manifest.ocdbt" in " ".join(report.files.problems)


def test_root_document_names_its_layout_and_an_unknown_one_is_refused():
    md = CheckpointMetadata(world_size=1, tensors={}, objects={}, layout="packed", array_options=ArrayOptions(),
                            data_files=DataFiles(None, (RankFiles(),)))
    assert md.to_dict()["layout"] == "packed"
    assert layout_for(CheckpointMetadata.from_dict(md.to_dict())).name == "packed"
    legacy = {k: v for k, v in md.to_dict().items() if k != "layout"}
    assert CheckpointMetadata.from_dict(legacy).layout == "plain"  # written before layouts existed
    with pytest.raises(MetadataError, match="unknown storage layout 'flat'"):
        layout_for(CheckpointMetadata.from_dict(md.to_dict() | {"layout": "flat"}))
    with pytest.raises(MetadataError, match="'layout' has the wrong type"):
        CheckpointMetadata.from_dict(md.to_dict() | {"layout": 3})


def test_every_key_is_stored_where_the_index_says_and_tensorstore_reads_the_index(tmp_path):
    """The index tsckpt writes is OCDBT as TensorStore reads it: the same keys, values and bytes."""
    import json

    sd, path = state(), str(tmp_path / "ck")
    tsckpt.save(sd, path, layout="packed")
    md = json.load(open(os.path.join(path, "zarr.json")))["attributes"]["tsckpt"]
    ours = packed_values(path, md)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    assert sorted(k.decode() for k in kv.list().result()) == sorted(ours)
    for key, value in ours.items():
        stored = kv.read(key).result().value
        if isinstance(value, bytes):
            assert stored == value, key
        else:
            with open(os.path.join(path, value.path), "rb") as f:
                f.seek(value.offset)
                assert stored == f.read(value.length), key


def test_a_rank_writes_its_values_back_to_back_in_one_file(tmp_path):
    sd = {f"w{i}": torch.randn(64, 256) for i in range(12)}  # 64 KiB each, 768 KiB in all
    path = str(tmp_path / "ck")
    tsckpt.save(sd, path, layout="packed")
    data = [f for f in files(path) if re.match(r"d/[0-9a-f]{32}-0$", f)]
    assert len(data) == 1
    md = tsckpt.open(path).metadata
    [record] = md.data_files.ranks
    assert [f.path for f in record.files] == data and record.files[0].size == os.path.getsize(os.path.join(path, data[0]))
    # the chunks (each its data and a crc32c per inner chunk, then the index), then the chunk table
    assert record.table.path == data[0] and record.table.offset + record.table.length == record.files[0].size
    assert sum(64 * 256 * 4 for _ in sd) < record.table.offset < sum(64 * 256 * 4 for _ in sd) * 1.01
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    tsckpt.load(out, path)
    assert all(torch.equal(out[k], sd[k]) for k in sd)


# --- DCP's own planners on real ranks ------------------------------------------------------------

WORLD = 3


def _uneven(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = state(5)
    return {"embed": distribute_tensor(full["model"]["embed"], mesh, [Shard(0)]),  # 97 rows on 3 ranks
            "w": distribute_tensor(full["model"]["w"], mesh, [Shard(1)]),
            "norm": full["model"]["norm"], "step": 7}


def _dcp_round_trip(rank: int, world: int, path: str) -> list[str]:
    sd = _uneven(world)
    dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(path, single_file_per_rank=True))
    dist.barrier()
    out = {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in sd.items()}
    dcp.load(out, storage_reader=tsckpt.TensorStoreReader(path))
    bad = [k for k, v in sd.items() if torch.is_tensor(v) and not torch.equal(out[k].full_tensor()
           if hasattr(out[k], "full_tensor") else out[k], v.full_tensor() if hasattr(v, "full_tensor") else v)]
    return bad + ([] if out["step"] == 7 else ["step"])


def test_dcp_default_planners_with_single_file_per_rank_write_one_data_file_per_rank(tmp_path):
    path = str(tmp_path / "ck")
    assert run_ranks(WORLD, _dcp_round_trip, path) == [[]] * WORLD
    found = files(path)
    assert all(PACKED_FILE.match(f) for f in found), found
    assert sorted(int(f.rsplit("-", 1)[1]) for f in found if re.match(r"d/[0-9a-f]{32}-\d+$", f)) == list(range(WORLD))
    assert len(found) == WORLD + 3
    assert tsckpt.open(path).metadata.layout == "packed" and tsckpt.verify(path).ok


def test_packed_checkpoint_in_memory_location_reads_through_tensorstore_spec():
    location = "memory://packed-tests/spec"
    sd = {"w": torch.randn(9, 4)}
    tsckpt.save(sd, location, layout="packed")
    spec = {"driver": "zarr3", "kvstore": packed.read_kvstore(dict(parse_location(location).spec), "w")}
    arr = ts.open(spec, context=tsckpt.open(location).store.context).result()
    np.testing.assert_array_equal(arr.read().result(), sd["w"].numpy())


# --- the default layout from the environment -------------------------------------------------


def test_tsckpt_layout_env_picks_the_layout_of_saves_and_conversions_that_name_none(tmp_path, monkeypatch):
    monkeypatch.setenv("TSCKPT_LAYOUT", "packed")
    tsckpt.save(state(), str(tmp_path / "env"))
    assert layout_of(tmp_path / "env") == "packed"
    tsckpt.convert(str(tmp_path / "env"), str(tmp_path / "conv"), to="tsckpt")
    assert layout_of(tmp_path / "conv") == "packed"
    # A layout named in the call wins over the environment.
    tsckpt.save(state(), str(tmp_path / "named"), layout="plain")
    assert layout_of(tmp_path / "named") == "plain"
    monkeypatch.setenv("TSCKPT_LAYOUT", "plain")
    tsckpt.save(state(), str(tmp_path / "plain"))
    assert layout_of(tmp_path / "plain") == "plain"


def test_an_unknown_tsckpt_layout_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("TSCKPT_LAYOUT", "zip")
    with pytest.raises(TsckptError, match=r"TSCKPT_LAYOUT='zip': unknown storage layout; expected one of "
                                          r"\['packed', 'plain'\]"):
        tsckpt.TensorStoreWriter(str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "c")


def _save_with_rank_layouts(rank, world, path):
    # Each rank's writer was told a different layout: the coordinator's must win everywhere.
    sd = {"w": torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)[rank * 4:(rank + 1) * 4]}
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard
    mesh = DeviceMesh("cpu", list(range(world)))
    sd["w"] = DTensor.from_local(sd["w"], mesh, [Shard(0)])
    dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(path, layout="packed" if rank == 0 else "plain"))
    return None


def test_every_rank_writes_in_the_coordinators_layout(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(2, _save_with_rank_layouts, path)
    assert layout_of(path) == "packed"
    assert all(PACKED_FILE.match(f) for f in files(path)), files(path)
    np.testing.assert_array_equal(tsckpt.open(path)["w"].numpy(), np.arange(48, dtype=np.float32).reshape(8, 6))
