"""``tsckpt.zarr_store``: zarr-python, dask and xarray reading plain and packed checkpoints through TensorStore."""

from __future__ import annotations

import pickle

import dask.array as da
import crc32c
import numpy as np
import pytest
import torch
import zarr
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import LocalStore

import tsckpt
from tsckpt.storage.context import make_context, open_kvstore
from tsckpt.storage.location import parse_location
from tsckpt.read.zarr_store import TensorStoreZarrStore

RANGES = [None, RangeByteRequest(1, 5), RangeByteRequest(0, 1), OffsetByteRequest(3), SuffixByteRequest(4),
          RangeByteRequest(2, 10**9), OffsetByteRequest(10**9), SuffixByteRequest(10**9)]
BUCKET = "tsckpt-zarr-store"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)


def state() -> dict:
    g = torch.Generator().manual_seed(11)
    return {"model": {"w": torch.randn(40, 24, generator=g), "b": torch.randn(9, generator=g).double()},
            "step": torch.tensor(5)}


def collect(iterator) -> list[str]:
    async def run():
        return [k async for k in iterator]
    return sorted(sync(run()))


def get(store, key, byte_range=None):
    buf = sync(store.get(key, default_buffer_prototype(), byte_range))
    return None if buf is None else buf.to_bytes()


def get_reference(value: bytes, byte_range) -> bytes:
    """What zarr's MemoryStore returns for ``byte_range`` of ``value``."""
    store = zarr.storage.MemoryStore({"k": default_buffer_prototype().buffer.from_bytes(value)})
    return get(store, "k", byte_range)


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("plain") / "ck")
    tsckpt.save(state(), path, layout="plain")
    return path


@pytest.fixture(scope="module")
def packed_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("packed") / "ck")
    tsckpt.save(state(), path, layout="packed")
    return path


def test_plain_checkpoint_serves_the_same_bytes_and_listings_as_zarrs_local_store(plain_ckpt):
    ours, local = tsckpt.zarr_store(plain_ckpt), LocalStore(plain_ckpt, read_only=True)
    assert ours.layout == "plain"
    keys = collect(local.list())
    assert collect(ours.list()) == keys and "model/w/zarr.json" in keys
    for key in keys:
        for byte_range in RANGES:
            assert get(ours, key, byte_range) == get(local, key, byte_range), (key, byte_range)
        assert sync(ours.exists(key)) and sync(ours.getsize(key)) == sync(local.getsize(key))
    for prefix in ("", "model", "model/", "model/w", "nothing"):
        assert collect(ours.list_dir(prefix)) == collect(local.list_dir(prefix)), prefix
    for prefix in ("", "model/", "model/w/", "nothing/"):
        assert collect(ours.list_prefix(prefix)) == collect(local.list_prefix(prefix)), prefix
    assert collect(ours.list_prefix("model/w/c")) == ["model/w/c.0.0"]
    assert get(ours, "model/nothing") is None and not sync(ours.exists("model/nothing"))


def test_packed_checkpoint_keys_come_from_the_database_and_the_root_document_from_beside_it(packed_ckpt):
    store = tsckpt.zarr_store(packed_ckpt)
    assert store.layout == "packed"
    keys = collect(store.list())
    assert keys == sorted(["zarr.json", "model/zarr.json", "model/w/zarr.json", "model/w/c.0.0",
                           "model/b/zarr.json", "model/b/c.0", "step/zarr.json", "step/c"])
    assert not [k for k in keys if "ocdbt" in k or k.startswith("d/")]  # the databases' own files stay hidden
    assert collect(store.list_dir("")) == ["model", "step", "zarr.json"]
    assert collect(store.list_dir("model")) == ["b", "w", "zarr.json"]
    chunk = get(store, "model/b/c.0")
    raw = state()["model"]["b"].numpy().tobytes()  # then the crc32c every chunk carries
    assert chunk == raw + crc32c.crc32c(raw).to_bytes(4, "little")
    for byte_range in RANGES[1:]:
        assert get(store, "model/b/c.0", byte_range) == get_reference(chunk, byte_range), byte_range
    group = zarr.open_group(store, mode="r")
    np.testing.assert_array_equal(group["model/w"][...], state()["model"]["w"].numpy())
    assert group["step"][...] == 5


def test_store_refuses_writes_pickles_and_compares(packed_ckpt):
    store = tsckpt.zarr_store(packed_ckpt)
    group = zarr.open_group(store)  # default mode "a": must still open the read-only checkpoint
    with pytest.raises(ValueError, match="read-only through zarr_store"):
        group.create_array("new", shape=(2,), dtype="float32")
    with pytest.raises(ValueError, match="read-only"):
        sync(store.delete("model/w/c.0.0"))
    assert get(store, "model/w/c.0.0") is not None
    clone = pickle.loads(pickle.dumps(store))  # dask pickles stores
    assert clone == store and hash(clone) == hash(store) and clone is not store
    np.testing.assert_array_equal(zarr.open_array(clone, path="model/b", mode="r")[...], state()["model"]["b"])
    ro = store.with_read_only(True)
    assert ro.read_only and ro != store and zarr.open_group(ro, mode="r")["step"][...] == 5
    assert str(store) == packed_ckpt and "packed" in repr(store)


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_xarray_and_dask_read_every_tensor(tmp_path, layout):
    import xarray as xr

    path = str(tmp_path / "ck")
    tsckpt.save(state(), path, layout=layout)
    ds = xr.open_zarr(tsckpt.zarr_store(path), group="model", consolidated=False, zarr_format=3)
    assert sorted(ds.data_vars) == ["b", "w"] and ds["w"].dims == ("w_0", "w_1")
    for name, t in state()["model"].items():
        np.testing.assert_array_equal(ds[name].values, t.numpy())
    lazy = da.from_zarr(tsckpt.zarr_store(path), component="model/w")
    np.testing.assert_array_equal(lazy[3:30, 2:7].compute(), state()["model"]["w"].numpy()[3:30, 2:7])


# --- object storage --------------------------------------------------------------


def _ranks_save_to(rank: int, world: int, location) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    sd = {f"w{i}": distribute_tensor(torch.randn(64, 128, generator=g), mesh, [Shard(0)]) for i in range(4)}
    tsckpt.save(sd, location, layout="packed")


def test_packed_checkpoint_on_s3_from_two_ranks_reads_through_zarr_and_holds_a_file_per_rank(s3):
    from dist import run_ranks

    location = s3.location(BUCKET, "zarr-store/packed")
    run_ranks(2, _ranks_save_to, location)
    g = torch.Generator().manual_seed(3)
    expected = [torch.randn(64, 128, generator=g).numpy() for _ in range(4)]
    store = tsckpt.zarr_store(location)
    assert isinstance(store, TensorStoreZarrStore) and store.layout == "packed"
    group = zarr.open_group(store, mode="r")
    for i, want in enumerate(expected):
        np.testing.assert_array_equal(group[f"w{i}"][...], want)
    np.testing.assert_array_equal(da.from_zarr(store, component="w2")[5:60, 7:9].compute(), expected[2][5:60, 7:9])

    loc = parse_location(location)
    kv = open_kvstore(loc, make_context(location=loc))
    objects = sorted(k.decode() for k in kv.list().result())
    # one data file per rank; the index, the manifest and the root zarr.json
    assert len(objects) == 2 + 3, objects
    index = [k for k in objects if k.endswith(".index")]
    assert len(index) == 1 and len(kv.read(index[0]).result().value) < 4096  # where the data is, not the data


def test_plain_checkpoint_on_s3_reads_through_zarr(s3):
    location = s3.location(BUCKET, "zarr-store/plain")
    w = torch.randn(10, 3)
    tsckpt.save({"w": w, "lr": 0.5}, location)
    group = zarr.open_group(tsckpt.zarr_store(location), mode="r")
    np.testing.assert_array_equal(group["w"][...], w.numpy())
    assert group.attrs["tsckpt"]["objects"]["lr"]["value"] == 0.5
