"""``tsckpt.zarr_store``: zarr-python, dask and xarray reading plain and packed checkpoints through TensorStore."""

from __future__ import annotations

import pickle

import dask.array as da
import ml_dtypes
import numpy as np
import pytest
import torch
import zarr
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import LocalStore

import packed_build as pb
import tsckpt
from test_s3 import BUCKET, s3  # noqa: F401  (the moto S3 server fixture, one per module)
from tsckpt.location import make_context, open_kvstore, parse_location
from tsckpt.zarr_kvstore import TensorStoreZarrStore

RANGES = [None, RangeByteRequest(1, 5), RangeByteRequest(0, 1), OffsetByteRequest(3), SuffixByteRequest(4),
          RangeByteRequest(2, 10**9), OffsetByteRequest(10**9), SuffixByteRequest(10**9)]


def tensors() -> list[pb.Tensor]:
    rng = np.random.default_rng(11)
    return [
        pb.Tensor(("model", "w"), rng.integers(0, 1 << 16, (40, 24), dtype=np.uint16).view(ml_dtypes.bfloat16),
                  "bfloat16"),
        pb.Tensor(("model", "b"), rng.standard_normal(9).astype(np.float32), "float32"),
        pb.Tensor(("step",), np.array(5, dtype=np.int64), "int64"),
    ]


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def collect(iterator) -> list[str]:
    async def run():
        return [k async for k in iterator]
    return sorted(sync(run()))


def get(store, key, byte_range=None):
    buf = sync(store.get(key, default_buffer_prototype(), byte_range))
    return None if buf is None else buf.to_bytes()


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    """A checkpoint written by tsckpt's own DCP writer (plain layout)."""
    path = str(tmp_path_factory.mktemp("plain") / "ck")
    sd = {"model": {"w": torch.randn(12, 5).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.float32)},
          "step": 4}
    tsckpt.save(sd, path)
    return path, sd


def test_plain_checkpoint_serves_the_same_bytes_and_listings_as_zarrs_local_store(plain_ckpt):
    path, _ = plain_ckpt
    ours, local = tsckpt.zarr_store(path), LocalStore(path, read_only=True)
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
    # Any string is a prefix, as the Store interface (and MemoryStore) has it; LocalStore only takes folders.
    assert collect(ours.list_prefix("model/w/c")) == ["model/w/c.0.0"]
    assert get(ours, "model/nothing") is None and not sync(ours.exists("model/nothing"))
    with open(f"{path}/zarr.json", "rb") as f:
        assert ours.get_sync("zarr.json", byte_range=RangeByteRequest(0, 3)).to_bytes() == f.read(3)


def test_plain_checkpoint_reads_through_zarr_and_dask(plain_ckpt):
    path, sd = plain_ckpt
    group = zarr.open_group(tsckpt.zarr_store(path))
    assert same(group["model/w"][...], sd["model"]["w"].view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    assert same(da.from_zarr(tsckpt.zarr_store(path), component="model/b").compute(), sd["model"]["b"].numpy())


def test_packed_checkpoint_keys_come_from_the_database_and_the_root_document_from_beside_it(tmp_path):
    ts_ = tensors()
    path = str(tmp_path / "ck")
    pb.save(path, ts_, 2, layout="packed")
    store = tsckpt.zarr_store(path)
    assert store.layout == "packed"
    keys = collect(store.list())
    assert keys == sorted(["zarr.json", "model/zarr.json", "model/w/zarr.json", "model/w/c.0.0", "model/w/c.1.0",
                           "model/b/zarr.json", "model/b/c.0", "model/b/c.1", "step/zarr.json", "step/c"])
    assert not [k for k in keys if "ocdbt" in k or k.startswith("d/")]  # the databases' own files stay hidden
    assert collect(store.list_dir("")) == ["model", "step", "zarr.json"]
    assert collect(store.list_dir("model")) == ["b", "w", "zarr.json"]
    assert collect(store.list_prefix("model/w/c")) == ["model/w/c.0.0", "model/w/c.1.0"]
    chunk = get(store, "model/w/c.1.0")
    assert chunk == ts_[0].data[20:].tobytes()
    for byte_range in RANGES[1:]:
        assert get(store, "model/w/c.1.0", byte_range) == get_reference(chunk, byte_range), byte_range
    assert get(store, "zarr.json")[:1] == b"{"
    group = zarr.open_group(store, mode="r")
    for t in ts_:
        assert same(group[t.path][...], t.data), t.path


def get_reference(value: bytes, byte_range) -> bytes:
    """What zarr's MemoryStore returns for ``byte_range`` of ``value``."""
    store = zarr.storage.MemoryStore({"k": default_buffer_prototype().buffer.from_bytes(value)})
    return get(store, "k", byte_range)


def test_store_refuses_writes_pickles_and_compares(tmp_path):
    path = str(tmp_path / "ck")
    pb.save(path, tensors(), 2, layout="packed")
    store = tsckpt.zarr_store(path)
    group = zarr.open_group(store)
    with pytest.raises(ValueError, match="read-only through zarr_store"):
        group.create_array("new", shape=(2,), dtype="float32")
    with pytest.raises(ValueError, match="read-only"):
        sync(store.delete("model/w/c.0.0"))
    assert get(store, "model/w/c.0.0") is not None
    clone = pickle.loads(pickle.dumps(store))
    assert clone == store and hash(clone) == hash(store) and clone is not store
    assert same(zarr.open_array(clone, path="model/b", mode="r")[...], tensors()[1].data)
    ro = store.with_read_only(True)
    assert ro.read_only and ro != store and zarr.open_group(ro, mode="r")["step"][...] == 5
    assert str(store) == path and "packed" in repr(store)


def test_xarray_reads_every_tensor_of_arrays_with_dimension_names(tmp_path):
    # xarray needs Zarr v3 ``dimension_names``, which tsckpt's arrays do not carry yet; the store is not the limit.
    xr = pytest.importorskip("xarray")
    path = str(tmp_path / "ck")
    rng = np.random.default_rng(2)
    ts_ = [pb.Tensor(("model", "w"), rng.standard_normal((6, 4)).astype(np.float32), "float32", ("w_0", "w_1")),
           pb.Tensor(("model", "b"), rng.standard_normal(9).astype(np.float64), "float64", ("b_0",))]
    pb.save(path, ts_, 2, layout="packed")
    ds = xr.open_zarr(tsckpt.zarr_store(path), group="model", consolidated=False, zarr_format=3)
    assert sorted(ds.data_vars) == ["b", "w"]
    for t in ts_:
        assert same(ds[t.key_path[-1]].values, t.data)


# --- object storage --------------------------------------------------------------


def test_packed_checkpoint_on_s3_reads_through_zarr_and_is_joined_by_reference(s3):
    ts_ = [pb.Tensor(("model", f"w{i}"), np.random.default_rng(i).standard_normal((64, 128)).astype(np.float32),
                     "float32") for i in range(4)]
    location = s3.location(BUCKET, "zarr-store/packed")
    pb.save(location, ts_, 2, layout="packed")
    store = tsckpt.zarr_store(location)
    assert isinstance(store, TensorStoreZarrStore) and store.layout == "packed"
    group = zarr.open_group(store, mode="r")
    for t in ts_:
        assert same(group[t.path][...], t.data)
    assert same(da.from_zarr(store, component="model/w2")[5:60, 7:9].compute(), ts_[2].data[5:60, 7:9])

    loc = parse_location(location)
    kv = open_kvstore(loc, make_context(location=loc))
    objects = sorted(k.decode() for k in kv.list().result())
    root_data = [k for k in objects if k.startswith("d/")]
    root_bytes = sum(len(kv.read(k).result().value) for k in root_data)
    assert root_bytes < sum(t.data.nbytes for t in ts_) / 20, (root_bytes, objects)
    assert len(objects) <= 2 + 3, objects  # a data file per rank; root: manifest, B+tree file, zarr.json


def test_plain_checkpoint_on_s3_reads_through_zarr(s3):
    location = s3.location(BUCKET, "zarr-store/plain")
    w = torch.randn(10, 3)
    tsckpt.save({"w": w, "lr": 0.5}, location)
    group = zarr.open_group(tsckpt.zarr_store(location), mode="r")
    assert same(group["w"][...], w.numpy()) and group.attrs["tsckpt"]["objects"]["lr"]["value"] == 0.5
