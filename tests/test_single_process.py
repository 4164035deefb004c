"""Save and load in one process, with no process group: DCP's no-dist mode."""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr

import tsckpt
import zoo


def test_every_dtype_and_0d_round_trips_bit_exactly(tmp_path):
    sd = {f"t{i}": zoo.expected(str(dt), (3, 5), dt) for i, dt in enumerate(zoo.DTYPES)}
    sd["step"] = torch.tensor(12.0)
    sd["empty"] = torch.zeros(0, 4)
    tsckpt.save(sd, tmp_path / "c")
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    tsckpt.load(back, tmp_path / "c")
    for k, v in sd.items():
        a, b = (v.view(torch.uint8), back[k].view(torch.uint8)) if v.dtype.itemsize == 1 else (v, back[k])
        assert back[k].dtype == v.dtype and torch.equal(a, b), k


def test_dcp_calls_with_path_in_constructor_and_default_planner(tmp_path):
    sd = {"w": torch.arange(12.0).reshape(3, 4), "n": 5, "cfg": {"a": [1, 2]}}
    dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(tmp_path / "c"))
    back = {"w": torch.zeros(3, 4), "n": 0, "cfg": {"a": None}}
    dcp.load(back, storage_reader=tsckpt.TensorStoreReader(tmp_path / "c"))
    assert torch.equal(back["w"], sd["w"]) and back["n"] == 5 and back["cfg"] == {"a": [1, 2]}
    np.testing.assert_array_equal(zarr.open_array(tsckpt.zarr_store(tmp_path / "c"), path="w")[...],
                                  sd["w"].numpy())


def test_values_are_stored_as_readable_json_and_odd_ones_safely(tmp_path):
    sd = {"lr": 1e-3, "betas": (0.9, 0.95), "name": "r", "ids": {3: "x"}, "odd": datetime.date(2026, 1, 2),
          "rng": torch.get_rng_state()}
    tsckpt.save(sd, tmp_path / "c")
    doc = zarr.open_group(str(tmp_path / "c"), mode="r").attrs["tsckpt"]
    assert doc["objects"]["lr"] == {"key_path": ["lr"], "encoding": "json", "value": 1e-3}
    assert doc["objects"]["odd"]["encoding"] == "torch"
    assert "rng" in doc["tensors"]  # the RNG state is a uint8 tensor, stored as an array
    back = {"lr": None, "betas": None, "name": None, "ids": {3: None}, "odd": None, "rng": torch.empty_like(sd["rng"])}
    with pytest.raises(tsckpt.UnsafeObjectError, match="'odd'.*allow_pickle"):
        tsckpt.load(back, tmp_path / "c")
    tsckpt.load(back, tmp_path / "c", allow_pickle=True)
    assert back["betas"] == (0.9, 0.95) and back["odd"] == datetime.date(2026, 1, 2)
    assert torch.equal(back["rng"], sd["rng"])


def test_missing_metadata_means_incomplete(tmp_path):
    tsckpt.save({"w": torch.ones(4)}, tmp_path / "c")
    (tmp_path / "c" / "zarr.json").unlink()
    with pytest.raises(tsckpt.IncompleteCheckpointError, match="save did not finish"):
        tsckpt.load({"w": torch.zeros(4)}, tmp_path / "c")
    with pytest.raises(BaseException, match="save did not finish"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=tsckpt.TensorStoreReader(tmp_path / "c"))
    with pytest.raises(tsckpt.CheckpointNotFoundError):
        tsckpt.load({"w": torch.zeros(4)}, tmp_path / "nothing")


def test_existing_checkpoint_needs_overwrite(tmp_path):
    tsckpt.save({"w": torch.ones(4)}, tmp_path / "c")
    with pytest.raises(tsckpt.CheckpointExistsError, match="overwrite=True"):
        tsckpt.save({"w": torch.zeros(4)}, tmp_path / "c")
    tsckpt.save({"v": torch.full((2,), 7.0)}, tmp_path / "c", overwrite=True)
    back = {"v": torch.zeros(2)}
    tsckpt.load(back, tmp_path / "c")
    assert back["v"].tolist() == [7.0, 7.0]
    assert not (tmp_path / "c" / "w").exists()  # nothing of the old checkpoint is left to mix in


def test_large_chunks_use_inner_chunks_and_slices_read_back(tmp_path):
    w = torch.randn(64, 48)
    tsckpt.save({"w": w}, tmp_path / "c", inner_chunk_bytes=2048)
    arr = zarr.open_array(tsckpt.zarr_store(tmp_path / "c"), path="w")
    # One shard (rounded up to whole inner chunks) of several inner chunks.
    assert all(s >= n for s, n in zip(arr.shards, (64, 48))) and arr.chunks != arr.shards
    np.testing.assert_array_equal(arr[5:9, 10:30], w[5:9, 10:30].numpy())
    back = {"w": torch.zeros(64, 48)}
    tsckpt.load(back, tmp_path / "c")
    assert torch.equal(back["w"], w)


def test_load_mismatches_name_the_key(tmp_path):
    tsckpt.save({"w": torch.ones(4, dtype=torch.float32)}, tmp_path / "c")
    with pytest.raises(tsckpt.LoadMismatchError, match="'w'.*shape"):
        tsckpt.load({"w": torch.zeros(5)}, tmp_path / "c")
    with pytest.raises(tsckpt.LoadMismatchError, match="'w'.*lose precision"):
        tsckpt.load({"w": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "c")
    back = {"w": torch.zeros(4, dtype=torch.float64)}  # widening is fine
    tsckpt.load(back, tmp_path / "c")
    assert back["w"].tolist() == [1.0] * 4


def test_stager_copies_tensor_bytes_keeps_ties_and_detaches_values():
    w = torch.arange(6.0).reshape(2, 3)
    sd = {"w": w, "tied": w, "view": w.t(), "opt": {"lr": [0.1]}, "n": 3}
    staged = tsckpt.Stager().stage(sd)
    w.add_(100)
    sd["opt"]["lr"].append(0.2)
    assert torch.equal(staged["w"], torch.arange(6.0).reshape(2, 3))
    assert staged["tied"] is staged["w"]  # one copy for tensors that share storage
    assert torch.equal(staged["view"], staged["w"].t())
    assert staged["opt"] == {"lr": [0.1]} and staged["n"] == 3


@pytest.mark.parametrize("window", [0, 20_000, None])
def test_loads_into_another_dtype_through_reused_buffers(tmp_path, window):
    """Values that cannot be read in place (here: bf16 into float32) wait in host buffers reused batch after
    batch; whatever the window, every tensor comes back exact, none holding another's bytes."""
    sd = {f"t{i}": torch.randn(100 + i, 37 + i).to(torch.bfloat16) for i in range(20)}
    sd["step"] = torch.tensor(3.0, dtype=torch.bfloat16)
    tsckpt.save(sd, str(tmp_path / "ck"))
    dst = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in sd.items()}
    dcp.load(dst, storage_reader=tsckpt.TensorStoreReader(str(tmp_path / "ck"), per_thread_copy_ahead=window))
    assert [k for k in sd if not torch.equal(dst[k], sd[k].float())] == []
