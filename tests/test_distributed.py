"""Real multi-process saves and resharded loads on spawned gloo ranks."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.distributed as dist
import zarr
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import tsckpt
import zoo
from zoo import same_bits
from dist import run_ranks
from tsckpt.commit import protocol as commit
from tsckpt.format.grid import ChunkGrid
from tsckpt.storage.context import make_context, open_kvstore
from tsckpt.storage.location import parse_location


# zoo4 and packed4, the 4-rank zoo saved plain and packed, are shared fixtures (conftest.py).


def test_4_rank_save_loads_into_full_tensors_without_process_group(zoo4):
    assert not dist.is_initialized()
    sd = zoo.empty_like_expected()
    tsckpt.load(sd, zoo4)
    zoo.assert_zoo_tensors(sd)
    assert sd["extra"] == {"lr": 0.1, "name": "run-1",
                           "groups": [{"lr": 0.01, "betas": (0.9, 0.99), "params": [0, 1]}]}


def test_packed_4_rank_save_loads_and_is_a_few_files(packed4):
    sd = zoo.empty_like_expected()
    tsckpt.load(sd, packed4)
    zoo.assert_zoo_tensors(sd)
    md = commit.read_metadata(open_kvstore(parse_location(packed4), make_context()), packed4)
    assert md.layout == "packed"
    files = [os.path.relpath(os.path.join(d, f), packed4) for d, _, fs in os.walk(packed4) for f in fs]
    # the root document, the joined database (manifest + B+tree file) and each rank's data files; no chunk files
    assert "zarr.json" in files and "manifest.ocdbt" in files and len(files) <= 1 + 2 + 4 * 2, files
    assert not any(f.startswith("model") for f in files)


def test_zarr_python_and_dask_read_a_packed_checkpoint(packed4):
    import dask.array as da

    group = zarr.open_group(tsckpt.zarr_store(packed4), mode="r")
    expected = zoo.expected_all()
    for name in ("even", "mesh2d", "st", "repl", "hybrid"):  # the float32 ones: numpy has no bfloat16
        np.testing.assert_array_equal(group["model"][name][...], expected[name].numpy())
        lazy = da.from_zarr(group["model"][name])
        np.testing.assert_array_equal(lazy.compute(), expected[name].numpy())
    assert group["model"]["even"].attrs["tsckpt"]["key"] == "model.even"


def test_packed_reshard_4_ranks_to_2(packed4):
    # Whole interpreters, not forked ranks: a packed load once left TensorStore objects to interpreter
    # finalization, which aborted the rank there (tools/loop_packed_reshard.py); only a real exit shows that.
    assert run_ranks(2, load_resharded, packed4, "", whole_interpreters=True) == [[], []]


def test_packed_verify_convert_and_diff(packed4, tmp_path):
    import shutil

    from typer.testing import CliRunner

    import tsckpt.cli.convert  # noqa: F401  (registers the commands)
    from damage import write_key
    from tsckpt.cli import app

    assert tsckpt.verify(packed4).ok
    plain, repacked = str(tmp_path / "plain"), str(tmp_path / "repacked")
    runner = CliRunner()
    for src, dst, layout in ((packed4, plain, "plain"), (plain, repacked, "packed")):
        out = runner.invoke(app, ["convert", src, dst, "--layout", layout, "-q"])
        assert out.exit_code == 0, out.output
    assert os.path.isdir(os.path.join(plain, "model", "even"))
    assert os.path.exists(os.path.join(repacked, "manifest.ocdbt"))
    assert tsckpt.diff(packed4, plain).identical and tsckpt.diff(plain, repacked).identical
    assert tsckpt.verify(repacked).ok
    # A chunk key missing from the index is found there (there are no chunk files to look at).
    damaged = str(tmp_path / "damaged")
    shutil.copytree(packed4, damaged)
    write_key(damaged, "model/even/c.1.0", None)
    report = tsckpt.verify(damaged)
    assert [e.key for e in report.failed] == ["model.even"]
    assert "c.1.0" in " ".join(report.failed[0].problems)


def test_zarr_python_reads_float32_written_by_4_ranks(zoo4):
    group = zarr.open_group(zoo4, mode="r")
    model = group["model"]
    expected = zoo.expected_all()
    for name in ("even", "mesh2d", "st", "repl", "hybrid"):
        np.testing.assert_array_equal(model[name][...], expected[name].numpy())
    assert model["even"].attrs["tsckpt"]["key"] == "model.even"


def _writers(ckpt, key) -> list:
    """The rank that saved each chunk, in row-major grid order (from the ranks' digest tables)."""
    found = tsckpt.open(ckpt)[key].writers()
    return [found[i] for i in sorted(found)]


def test_every_chunk_file_has_exactly_one_writing_rank(zoo4):
    doc = json.load(open(os.path.join(zoo4, "zarr.json")))["attributes"]["tsckpt"]
    checked = 0
    for key, t in doc["tensors"].items():
        array_dir = os.path.join(zoo4, t["path"])
        # Chunk files are "c" (0-d) or "c.i.j" beside the array's zarr.json.
        on_disk = {tuple(int(p) for p in f.split(".")[1:]) for f in os.listdir(array_dir)
                   if f == "c" or f.startswith("c.")}
        grid = ChunkGrid(tuple(t["shape"]), tuple(t["chunk_shape"]))
        writers = _writers(zoo4, key)
        # one writing rank recorded per chunk of the grid, and every chunk of the grid on disk
        assert len(writers) == grid.nchunks and all(0 <= r < 4 for r in writers), (key, writers)
        assert on_disk == set(grid.indices()), key
        checked += len(on_disk)
    assert checked > 50


def test_metadata_records_meshes_placements_and_dedups_replicas(zoo4):
    md = commit.read_metadata(open_kvstore(parse_location(zoo4), make_context()), zoo4)
    doc = json.load(open(os.path.join(zoo4, "zarr.json")))["attributes"]["tsckpt"]
    assert md.world_size == 4
    assert {(m.shape, m.dim_names) for m in md.meshes} == {((4,), None), ((2, 2), ("dp", "tp"))}
    t = md.tensors["model.mesh2d"]
    assert t.placement.to_dict()["placements"] == [{"type": "shard", "dim": 0}, {"type": "shard", "dim": 1}]
    assert md.meshes[t.placement.mesh].shape == (2, 2)
    assert md.tensors["model.uneven"].chunk_shape == (3, 3)       # torch.chunk: 3,3,3,1
    assert md.tensors["model.nested"].chunk_shape == (1, 4)       # 3,2,3,2 rows: gcd
    assert md.tensors["model.st"].placement.kind == "sharded_tensor"
    # rows 2,1,3,3,1 of the ShardedTensor come from its 5 shards on 4 ranks
    assert _writers(zoo4, "model.st") == [0, 0, 1, 2, 2, 2, 3, 3, 3, 0]
    # A replicated tensor is written once; replicas of a hybrid tensor are spread over ranks.
    assert len(_writers(zoo4, "model.repl")) == 1
    assert len(_writers(zoo4, "model.plain")) == 1
    assert len(set(_writers(zoo4, "model.hybrid"))) == 2
    assert md.codec_checksums and not any("checksums" in t for t in doc["tensors"].values())  # beside each chunk
    assert md.objects["extra.lr"].encoding == "json" and md.objects["extra.lr"].value == 0.1


def load_resharded(rank, world, path, also):
    """Load the 4-rank zoo into other placements on `world` ranks; return mismatching keys."""
    mesh = init_device_mesh("cpu", (world,))
    e = zoo.expected_all()
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    targets = {
        "even": (mesh, [Shard(1)]),          # row-sharded -> column-sharded
        "uneven": (mesh, [Shard(0)]),
        "zero": (mesh, [Shard(1)]),
        "cols": (mesh, [Shard(0)]),
        "mesh2d": (mesh, [Shard(1)]),        # (2,2) mesh -> 1-D mesh
        "nested": (mesh, [Replicate()]),
        "repl": (mesh, [Shard(0)]),
        "hybrid": (mesh, [Shard(1)]),
        "plain": (mesh, [Shard(0)]),
    }
    model = {k: distribute_tensor(torch.zeros_like(e[k]), m, p, src_data_rank=None) for k, (m, p) in targets.items()}
    model["scalar"] = torch.zeros(())
    model["st"] = distribute_tensor(torch.zeros_like(e["st"]), mesh, [Shard(0)], src_data_rank=None)  # ShardedTensor -> DTensor
    if also == "dtensor_to_sharded":
        model["even"] = zoo.sharded_tensor(torch.zeros_like(e["even"]), [3, 5] if world == 2 else [2, 2, 2, 2], world)
    sd = {"model": model}
    tsckpt.load(sd, path, allow_partial_load=False)
    bad = []
    for k, v in sd["model"].items():
        if isinstance(v, DTensor):
            full = v.full_tensor()
        elif isinstance(v, ShardedTensor):
            full = torch.zeros_like(e[k]) if rank == 0 else None
            v.gather(0, full)
            if rank != 0:
                continue
        else:
            full = v
        if not same_bits(full, e[k]):
            bad.append(k)
    return bad


def test_reshard_4_ranks_to_2(zoo4):
    assert run_ranks(2, load_resharded, zoo4, "") == [[], []]


def test_reshard_dtensor_to_sharded_tensor(zoo4):
    assert run_ranks(2, load_resharded, zoo4, "dtensor_to_sharded") == [[], []]


def save_two_ranks_and_load_four(rank, world, path4, path2):
    """On 4 ranks: load the (2,2)-mesh zoo into a (4,) mesh; then 2 ranks save and all 4 reload."""
    e = zoo.expected_all()
    mesh = init_device_mesh("cpu", (world,))
    target = {"model": {"mesh2d": distribute_tensor(torch.zeros(6, 8), mesh, [Shard(1)], src_data_rank=None)}}
    tsckpt.load(target, path4, allow_partial_load=True)
    ok = same_bits(target["model"]["mesh2d"].full_tensor(), e["mesh2d"])
    pair = dist.new_group([0, 1])
    if rank < 2:
        rows = e["uneven"][rank * 5:(rank + 1) * 5].clone()
        st = _sharded_rows(rows, rank * 5, 10, rank, pair)
        tsckpt.save({"w": st}, path2, process_group=pair)
    dist.barrier()
    loaded = {"w": distribute_tensor(torch.zeros(10, 3, dtype=torch.bfloat16), mesh, [Shard(0)], src_data_rank=None)}
    tsckpt.load(loaded, path2)
    return ok and same_bits(loaded["w"].full_tensor(), e["uneven"])


def _sharded_rows(rows, offset, total, rank, group):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as STShard, init_from_local_shards

    md = ShardMetadata([offset, 0], list(rows.shape), f"rank:{rank}/cpu")
    return init_from_local_shards([STShard(rows, md)], total, rows.shape[1], process_group=group)


def test_2d_mesh_to_1d_and_2_ranks_to_4(zoo4, tmp_path):
    assert run_ranks(4, save_two_ranks_and_load_four, zoo4, str(tmp_path / "two")) == [True] * 4


def fsdp_train_save(rank, world, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _fsdp_model(world)
    torch.manual_seed(1)
    for _ in range(2):
        model(torch.randn(4, 10)).sum().backward()
        optim.step()
        optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    tsckpt.save({"model": msd, "optim": osd}, path)
    return _full(msd, osd)


def _fsdp_model(world):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(msd, osd):
    out = {f"model.{k}": v.full_tensor() for k, v in msd.items()}
    for p, state in osd["state"].items():
        for k, v in state.items():
            out[f"optim.{p}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    out["lr"] = osd["param_groups"][0]["lr"]
    return out


def fsdp_load(rank, world, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _fsdp_model(world)
    model(torch.randn(2, 10)).sum().backward()
    optim.step()  # materialize optimizer state so it has the saved structure
    optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    tsckpt.load(sd, path)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    msd, osd = get_state_dict(model, optim)
    return _full(msd, osd)


def test_fsdp2_model_and_optimizer_round_trip_4_to_2(tmp_path):
    path = str(tmp_path / "fsdp")
    saved = run_ranks(4, fsdp_train_save, path)[0]
    loaded = run_ranks(2, fsdp_load, path)[0]
    assert set(saved) == set(loaded)
    for k in saved:
        if isinstance(saved[k], torch.Tensor):
            assert same_bits(saved[k], loaded[k]), k
        else:
            assert saved[k] == loaded[k], k
    assert any(".exp_avg_sq" in k for k in saved) and any(".step" in k for k in saved)


def _scribble(obj) -> None:
    """Flip every byte of every local tensor, as training would overwrite them."""
    if isinstance(obj, dict):
        for v in obj.values():
            _scribble(v)
    elif isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        shards = [s.tensor for s in local.local_shards()] if hasattr(local, "local_shards") else [local]
        for t in shards:
            torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).bitwise_not_()


def async_saves(rank, world, path):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    sd = zoo.zoo_state_dict(world)  # ShardedTensors too: tsckpt's Stager copies them, DCP's cannot
    thread = tsckpt.async_save(sd, path + "/thread", async_checkpointer_type=AsyncCheckpointerType.THREAD)
    _scribble(sd)  # after async_save returns the saved values must be the staged copy's
    thread.result()
    sd = zoo.zoo_state_dict(world, without=("st",))  # the process executor cannot pickle ShardedTensors
    proc = tsckpt.async_save(sd, path + "/process", async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    proc.result()
    writer = tsckpt.TensorStoreWriter()
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, storage_writer=writer, checkpoint_id=path + "/by_id")  # DCP's own planner, id at call time
    return True


def test_async_save_thread_and_process_modes_and_checkpoint_id(tmp_path):
    run_ranks(2, async_saves, str(tmp_path))
    expected = zoo.expected_all()
    for mode in ("thread", "process", "by_id"):
        sd = zoo.empty_like_expected(without=() if mode == "thread" else ("st",))
        tsckpt.load(sd, str(tmp_path / mode))
        for name in sd["model"]:
            assert same_bits(sd["model"][name], expected[name]), (mode, name)
        assert sd["extra"]["groups"][0]["betas"] == (0.9, 0.99), mode
