"""tsckpt.open: reading a 4-rank checkpoint in a plain process, lazily and chunk by chunk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch

import tsckpt
from damage import layout_of, write_key
import zoo
from tsckpt.format import dtypes
from tsckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError, TsckptError, UnsafeObjectError
from tsckpt.format.metadata import DTensorPlacement, ReplicatedPlacement, ShardedTensorPlacement
from tsckpt.read.checkpoint import KeyNotFoundError
from tsckpt.read.index import SelectionError, normalize_index, parse_index


def _key(name: str) -> str:
    return name if name.startswith("dtypes.") else f"model.{name}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare float8 and friends by their bits (torch.equal lacks kernels for some)."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _file_metrics() -> dict[str, int]:
    out = {}
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/"):
        if m["values"] and "value" in m["values"][0]:
            out[m["name"].rsplit("/", 1)[-1]] = m["values"][0]["value"]
    return out


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def test_open_exposes_keys_and_metadata(zoo_ckpt):
    ck = tsckpt.open(zoo_ckpt)
    expected = zoo.expected_all()
    assert set(ck) == {_key(k) for k in expected} | {
        "extra.lr", "extra.name", "extra.groups.0.lr", "extra.groups.0.betas", "extra.groups.0.params"}
    assert len(ck) == len(list(ck))
    assert ck.world_size == 4 and ck.metadata.world_size == 4
    assert ck.mesh is not None and ck.mesh.shape == (4,)
    assert [m.shape for m in ck.meshes] == [(4,), (2, 2)]
    assert ck.meshes[1].dim_names == ("dp", "tp")

    h = ck["model.mesh2d"]
    assert h.shape == (6, 8) and h.dtype == torch.float32 and h.zarr_dtype == "float32"
    assert h.numpy_dtype == np.dtype("float32") and h.nbytes == 6 * 8 * 4
    assert isinstance(h.placements, DTensorPlacement) and h.mesh == ck.meshes[1]
    assert [dict(p) for p in h.placements.placements] == [{"type": "shard", "dim": 0}, {"type": "shard", "dim": 1}]
    assert h.chunks.chunk_shape == (3, 4) and h.chunks.grid_shape == (2, 2) and h.chunks.nchunks == 4
    assert h.writers() == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}

    bf = ck["dtypes.bfloat16"]
    assert bf.dtype == torch.bfloat16 and bf.numpy_dtype == np.dtype(ml_dtypes.bfloat16) and bf.nbytes == 8 * 3 * 2
    assert isinstance(ck["model.st"].placements, ShardedTensorPlacement)
    assert isinstance(ck["model.plain"].placements, ReplicatedPlacement)
    assert ck["model.uneven"].chunks.chunk_shape == (3, 3)  # torch.chunk of 10 rows on 4 ranks


def test_every_tensor_reads_bit_exactly_as_torch_and_numpy(zoo_ckpt):
    ck = tsckpt.open(zoo_ckpt)
    for name, want in zoo.expected_all().items():
        h = ck[_key(name)]
        got = h[...]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(_bits(got), _bits(want)), name
        arr = h.numpy()
        assert arr.dtype == dtypes.tensor_as_numpy(want).dtype, name
        assert arr.tobytes() == dtypes.tensor_as_numpy(want.contiguous()).tobytes(), name


@pytest.mark.parametrize("index", [
    (slice(2, 7),), (slice(None), 1), -1, (slice(-3, None), slice(1, 3)), (slice(0, 10, 3),),
    (Ellipsis, 2), (slice(5, 2),), (4, 2),
])
def test_slices_match_torch_indexing(zoo_ckpt, index):
    ck = tsckpt.open(zoo_ckpt)
    want = zoo.expected_all()["uneven"]  # bf16, chunks of 3 rows
    got = ck["model.uneven"][index]
    assert got.shape == want[index].shape
    assert torch.equal(got, want[index])
    assert np.array_equal(ck["model.uneven"].numpy(slice=index), dtypes.tensor_as_numpy(want[index].contiguous()))


def test_bad_selections_and_keys_raise_clear_errors(zoo_ckpt):
    ck = tsckpt.open(zoo_ckpt)
    with pytest.raises(SelectionError, match="out of range for dim 0 of size 10"):
        ck["model.uneven"][10]
    with pytest.raises(SelectionError, match="3 indices for a tensor of shape"):
        ck["model.uneven"][0, 0, 0]
    with pytest.raises(SelectionError, match="positive"):
        ck["model.uneven"][::-1]
    with pytest.raises(KeyError, match="did you mean 'model.even'"):
        ck["model.evn"]
    with pytest.raises(KeyNotFoundError):
        ck["nope"]
    assert "nope" not in ck and "model.even" in ck


def test_values_and_nested_state_dict(zoo_ckpt):
    ck = tsckpt.open(zoo_ckpt)
    assert ck["extra.lr"] == 0.1 and ck["extra.name"] == "run-1"
    assert ck["extra.groups.0.betas"] == (0.9, 0.99)
    sd = ck.to_state_dict()
    assert sd["extra"] == {"lr": 0.1, "name": "run-1", "groups": [{"lr": 0.01, "betas": (0.9, 0.99), "params": [0, 1]}]}
    expected = zoo.expected_all()
    for name in zoo.SPECS:
        assert torch.equal(sd["model"][name], expected[name]), name
    for d in zoo.DTYPES:
        k = zoo.dtype_key(d)
        assert torch.equal(_bits(sd["dtypes"][k]), _bits(expected[f"dtypes.{k}"])), k


def test_open_reads_only_the_root_document(zoo_ckpt):
    before = _file_metrics()
    ck = tsckpt.open(zoo_ckpt)
    list(ck)
    h = ck["model.mesh2d"]
    _ = (h.shape, h.chunks, h.placements, h.nbytes, ck.meshes)
    # The root zarr.json (a one-byte probe of its size cap, then the document), nothing per array.
    assert _delta(before, _file_metrics()).get("read") == 2


def test_slice_reads_only_the_chunks_it_overlaps(zoo_ckpt, tmp_path):
    path = str(tmp_path / "zoo")
    shutil.copytree(zoo_ckpt, path)
    ck = tsckpt.open(path)
    h = ck["model.even"]  # (8, 6) in chunks of 2 rows: c/0/0 .. c/3/0
    region = (slice(2, 4), slice(None))
    wanted = h.chunks.chunks_overlapping(normalize_index(region, h.shape))
    assert wanted == [(1, 0)]
    for index in [(i, 0) for i in range(h.chunks.grid_shape[0])]:
        if index not in wanted:
            # Fails its crc32c if anyone reads it.
            write_key(path, "model/even/" + ".".join(["c", *map(str, index)]), b"not a chunk")

    ck = tsckpt.open(path)
    own = -(_rchar() - _rchar())  # what reading /proc/self/io itself adds
    before, read_before = _file_metrics(), _rchar()
    got = ck["model.even"][region]
    counts, nbytes = _delta(before, _file_metrics()), _rchar() - read_before - own
    assert torch.equal(got, zoo.expected_all()["even"][2:4])
    if layout_of(path) == "plain":
        # The one chunk, read with a file call: the root document says what the array is, no zarr.json read.
        size = os.path.getsize(os.path.join(path, "model/even/c.1.0"))
        assert counts.get("read", 0) == 0 and size <= nbytes <= size + 8, (counts, nbytes, size)
    else:  # the database's manifest and B+tree node (unless inline), then the chunk's bytes in one data file
        assert counts["read"] <= 3
    with pytest.raises(TsckptError, match="model.even"):
        ck["model.even"].numpy()


def test_sharded_array_slice_reads_a_fraction_of_the_shard(tmp_path):
    path = str(tmp_path / "one")
    w = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    tsckpt.save({"w": w}, path, inner_chunk_bytes=1024)  # one 16 KiB shard of 16x16 inner chunks
    ck = tsckpt.open(path)
    h = ck["w"]
    assert h.chunks.chunk_shape == (64, 64) and h.chunks.inner_chunk_shape == (16, 16)
    h.numpy((0, 0))  # open the array and read its zarr.json first
    # Bytes this process's read calls returned: tsckpt reads a local plain checkpoint's chunk files itself.
    before = _rchar()
    assert torch.equal(h[0:4, 16:32], w[0:4, 16:32])
    part = _rchar() - before
    before = _rchar()
    assert torch.equal(h[...], w)
    whole = _rchar() - before
    assert whole >= w.nbytes
    assert part < 2 * 1024 + 64 * 4 + 64  # one inner chunk plus the shard index, not the shard


def test_torch_serialized_values_decode_safely(tmp_path):
    path = str(tmp_path / "obj")
    tsckpt.save({"t": torch.ones(2), "size": torch.Size([3, 4]), "thing": _Thing(7)}, path)
    ck = tsckpt.open(path)
    assert ck["size"] == torch.Size([3, 4])
    with pytest.raises(UnsafeObjectError, match="'thing'.*allow_pickle=True"):
        ck["thing"]
    assert tsckpt.open(path, allow_pickle=True)["thing"].x == 7


class _Thing:
    def __init__(self, x: int):
        self.x = x


def test_incomplete_and_missing_checkpoints(zoo_ckpt, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at"):
        tsckpt.open(str(tmp_path / "missing"))
    path = tmp_path / "partial"
    shutil.copytree(zoo_ckpt, path)
    doc = json.loads((path / "zarr.json").read_text())
    doc["attributes"] = {}  # what a save that died before its commit leaves
    (path / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(IncompleteCheckpointError, match="incomplete checkpoint"):
        tsckpt.open(str(path))


def test_reading_to_numpy_never_imports_torch(zoo_ckpt):
    code = textwrap.dedent(f"""
        import sys
        import tsckpt
        ck = tsckpt.open({zoo_ckpt!r})
        keys = list(ck)
        h = ck["dtypes.bfloat16"]
        a = h.numpy()
        b = ck["model.mesh2d"].numpy(slice=(slice(0, 3), 1))
        _ = (h.shape, h.zarr_dtype, h.numpy_dtype, h.chunks, h.placements, h.nbytes, ck.mesh, ck.world_size)
        assert ck["extra.groups.0.betas"] == (0.9, 0.99)
        assert str(a.dtype) == "bfloat16" and b.shape == (3,)
        assert "torch" not in sys.modules, "torch was imported"
        print("ok", len(keys))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ok 35")


def test_parse_index():
    assert parse_index("0:4,2") == (slice(0, 4), 2)
    assert parse_index("::2, -1, ...") == (slice(None, None, 2), -1, Ellipsis)
    with pytest.raises(SelectionError, match="cannot parse 'x'"):
        parse_index("0:4,x")
