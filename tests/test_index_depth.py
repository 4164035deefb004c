"""A packed index of several levels: written by tsckpt, read back by TensorStore, zarr-python and tsckpt.

Two thousand small tensors make a B+tree of two levels with tsckpt's node
size; the index is then rewritten with nodes of 1 KiB (four levels and more),
as a save at a hundred times the scale would cut it. Each reader must find
every key through the interior nodes: TensorStore's ``ocdbt`` driver through
the manifest, zarr-python through ``tsckpt.zarr_store``, tsckpt through the
root node the root document names, reading only the nodes on its keys' way.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr

import tsckpt
from damage import _rewrite, packed_values
from tsckpt.format import ocdbt
from tsckpt.storage import packed

TENSORS = 2000


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"layers.{i}.w": torch.randn(4, 3 + i % 5, generator=g) for i in range(TENSORS)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("depth") / "ck"
    state = _state()
    tsckpt.save(state, path, layout="packed")
    return path, state


def _height(path) -> int:
    with open(os.path.join(path, ocdbt.MANIFEST_KEY), "rb") as f:
        return ocdbt.Manifest.decode(f.read(), ocdbt.MANIFEST_KEY).root_height


def _check_every_reader(path, state) -> None:
    md = json.load(open(os.path.join(path, "zarr.json")))["attributes"]["tsckpt"]
    ours = packed_values(path, md)
    # TensorStore: every key, every value, found from the manifest down.
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    assert sorted(k.decode() for k in kv.list().result()) == sorted(ours)
    for key in ("layers.0.w/c.0.0", f"layers.{TENSORS - 1}.w/zarr.json", "layers.1234.w/c.0.0"):
        value = ours[key]
        stored = kv.read(key).result().value
        if isinstance(value, bytes):
            assert stored == value
        else:
            with open(os.path.join(path, value.path), "rb") as f:
                f.seek(value.offset)
                assert stored == f.read(value.length)
    # zarr-python, through tsckpt's store.
    group = zarr.open_group(tsckpt.zarr_store(path), mode="r")
    for i in (0, 999, TENSORS - 1):
        assert np.array_equal(group[f"layers.{i}.w"][:], state[f"layers.{i}.w"].numpy())
    # tsckpt: a load of everything, and one tensor through a handle.
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    tsckpt.load(out, path)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert torch.equal(tsckpt.open(path)["layers.1500.w"][:], state["layers.1500.w"])
    assert tsckpt.verify(path).ok


def test_a_save_of_thousands_of_tensors_has_interior_nodes_every_reader_walks(saved):
    path, state = saved
    assert _height(path) >= 1
    _check_every_reader(path, state)


def test_an_index_of_tiny_nodes_is_read_through_every_level(saved, tmp_path, monkeypatch):
    path, state = saved
    copy = tmp_path / "ck"
    # The data files are shared; the root, the manifest and the index are the copy's own, rewritten below.
    shutil.copytree(path, copy, copy_function=os.link)
    md = json.load(open(copy / "zarr.json"))["attributes"]["tsckpt"]
    values = packed_values(copy, md)
    for name in ("zarr.json", ocdbt.MANIFEST_KEY, md["data_files"]["index"][0]):
        os.unlink(copy / name)
        shutil.copy(os.path.join(path, name), copy / name)
    monkeypatch.setattr(packed, "NODE_BYTES", 1024)
    _rewrite(copy, values)
    assert _height(copy) >= 3
    _check_every_reader(copy, state)


def test_a_lookup_reads_only_the_nodes_on_its_way(saved):
    path, _ = saved
    md = json.load(open(os.path.join(path, "zarr.json")))["attributes"]["tsckpt"]
    file, offset, length = md["data_files"]["index"]
    data = np.fromfile(os.path.join(path, file), dtype=np.uint8)
    files = [f[0] for r in md["data_files"]["ranks"] for f in r["files"]] + [file]
    from tsckpt.format.data_files import Span
    tree = packed.BTreeIndex(Span(file, offset, length), lambda spans: [data[o:o + n] for _, o, n in spans],
                             files, file)
    tree.lookup(["layers.7.w/c.0.0", "layers.7.w/c.9.9", "a", "zzz", "layers.7.w/zarr.json"])
    assert isinstance(tree.values["layers.7.w/c.0.0"], ocdbt.Ref)
    assert isinstance(tree.values["layers.7.w/zarr.json"], bytes)
    assert tree.values["layers.7.w/c.9.9"] is None and tree.values["a"] is None and tree.values["zzz"] is None
    # The root, one node per level below it for these neighbouring keys (and one for each end): a few
    # nodes of the node size, never the whole index.
    assert tree.bytes_read <= (_height(path) + 3) * 2 * packed.NODE_BYTES < offset + length
