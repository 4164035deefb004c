"""TensorStoreWriter/Reader as drop-ins for DCP's FileSystemWriter/Reader.

Their constructor arguments, DCP's own planners and plan caching, rank-local
saves, tensors that require grad, the log line and the single-process warning.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import pickle
import warnings

import numpy as np
import pytest
import tensorstore as ts
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import StreamTransformExtension, ZStandard
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import SerializationFormat
from typer.testing import CliRunner

import tsckpt
from dist import run_ranks
from tsckpt.cli import app
from tsckpt.cli import inspect as _commands  # noqa: F401 - registers info on app
from tsckpt.dcp.copy_window import DEFAULT_COPY_AHEAD, CopyWindow
from tsckpt.storage.layouts import LAYOUTS
from tsckpt.storage.location import parse_location
from tsckpt.storage import localfs
from tsckpt.storage.localfs import unsynced_nodes
from zoo import expected, same_bits


def _doc(path) -> dict:
    with open(os.path.join(path, "zarr.json")) as f:
        return json.load(f)["attributes"]["tsckpt"]


def _sd() -> dict:
    return {"w": expected("w", (6, 4), torch.float32), "h": expected("h", (5,), torch.bfloat16),
            "step": 7, "lr": 0.5, "names": ["a", "b"], "betas": (0.9, 0.99)}


def _load(path) -> dict:
    back = {"w": torch.zeros(6, 4), "h": torch.zeros(5, dtype=torch.bfloat16),
            "step": 0, "lr": 0.0, "names": [], "betas": ()}
    dcp.load(back, storage_reader=tsckpt.TensorStoreReader(path))
    return back


def _assert_same(back: dict, sd: dict) -> None:
    for k, v in sd.items():
        assert same_bits(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v, k


class Rot13(StreamTransformExtension):
    """A stream extension tsckpt cannot honour."""

    @staticmethod
    def registry_name() -> str:
        return "stream.rot13"

    @staticmethod
    def from_descriptor(version: str) -> Rot13:
        return Rot13()

    def get_descriptor(self) -> str:
        return "stream.rot13/1"

    def transform_to(self, output):
        return output

    def transform_from(self, input):
        return input


# --- constructor arguments ------------------------------------------------------------


@pytest.mark.parametrize("ours, theirs", [(tsckpt.TensorStoreWriter, FileSystemWriter),
                                          (tsckpt.TensorStoreReader, FileSystemReader)])
def test_every_filesystem_argument_is_accepted_in_the_same_position(ours, theirs):
    def positional(cls):
        return [n for n, p in inspect.signature(cls).parameters.items()
                if p.kind == p.POSITIONAL_OR_KEYWORD]

    assert positional(ours)[:len(positional(theirs))] == positional(theirs)


def test_filesystemwriter_arguments_positionally_round_trip(tmp_path):
    sd = _sd()
    # path, single_file_per_rank, sync_files, thread_count, per_thread_copy_ahead,
    # cache_staged_state_dict, overwrite, _extensions, serialization_format
    writer = tsckpt.TensorStoreWriter(tmp_path / "c", False, True, 3, 1 << 20, False, True, None,
                                      SerializationFormat.TORCH_SAVE)
    dcp.save(sd, storage_writer=writer)
    assert writer.io_concurrency == 3 and writer.context["file_io_concurrency"].to_json() == {"limit": 3}
    assert writer.per_thread_copy_ahead == 1 << 20 and writer.layout == "plain"
    reader = tsckpt.TensorStoreReader(tmp_path / "c", None)
    back = {"w": torch.zeros(6, 4), "h": torch.zeros(5, dtype=torch.bfloat16)}
    dcp.load(back, storage_reader=reader)
    _assert_same(back, {k: sd[k] for k in back})


def test_thread_count_is_io_concurrency_and_conflicts_are_refused():
    assert tsckpt.TensorStoreWriter("x", thread_count=5).io_concurrency == 5
    assert tsckpt.TensorStoreWriter("x", thread_count=5, io_concurrency=5).io_concurrency == 5
    with pytest.raises(tsckpt.TsckptError, match="thread_count=2 and io_concurrency=8"):
        tsckpt.TensorStoreWriter("x", thread_count=2, io_concurrency=8)
    with pytest.raises(tsckpt.TsckptError, match="thread_count=0"):
        tsckpt.TensorStoreWriter("x", thread_count=0)


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_sync_files_false_skips_fsync_and_says_so(tmp_path, monkeypatch, layout):
    syncs = []
    real_syncfs = localfs.syncfs_at
    monkeypatch.setattr(localfs, "syncfs_at", lambda path: syncs.append(path) or real_syncfs(path))
    sd = _sd()
    unsynced = tsckpt.TensorStoreWriter(tmp_path / "fast", sync_files=False, layout=layout)
    dcp.save(sd, storage_writer=unsynced)
    # The option travels as an option: the location is as given, TensorStore's own writes are told not to sync.
    assert unsynced.context["file_io_sync"].to_json() is False and not unsynced.store.location.context
    assert syncs == []  # no syncfs before the commit either
    assert _doc(tmp_path / "fast")["extra"]["synced"] is False
    _assert_same(_load(tmp_path / "fast"), sd)

    synced = tsckpt.TensorStoreWriter(tmp_path / "safe", layout=layout)
    dcp.save(sd, storage_writer=synced)
    assert synced.context["file_io_sync"].to_json() is True
    if layout == "plain" and unsynced_nodes(parse_location(tmp_path / "safe")) is not None:
        assert syncs  # chunk files and nodes made durable by syncfs, not an fsync each
    assert "synced" not in _doc(tmp_path / "safe")["extra"]


def test_single_file_per_rank_asks_for_the_packed_layout(monkeypatch):
    monkeypatch.delenv("TSCKPT_LAYOUT", raising=False)  # the default without it is packed
    assert tsckpt.TensorStoreWriter("x", single_file_per_rank=False).layout == "plain"
    assert tsckpt.TensorStoreWriter("x").layout == "packed"
    assert tsckpt.TensorStoreWriter("x", True).layout == "packed" and "packed" in LAYOUTS
    with pytest.raises(tsckpt.TsckptError, match="layout='plain'"):
        tsckpt.TensorStoreWriter("x", single_file_per_rank=True, layout="plain")


@pytest.mark.skipif(not ZStandard.is_available(), reason="torch's ZStandard() needs zstandard or pyzstd")
def test_zstandard_extension_is_the_zstd_codec(tmp_path):
    sd = {"z": torch.zeros(256, 64), "w": expected("w", (6, 4), torch.float32)}
    # single_file_per_rank=False: the plain layout, whose chunk files are measured below.
    dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(tmp_path / "c", False, _extensions=[ZStandard()]))
    with open(tmp_path / "c" / "z" / "zarr.json") as f:
        codecs = json.load(f)["codecs"]
    # Inner chunks compress inside the sharding codec, so zstd may be one level down.
    inner = [c for s in codecs if s["name"] == "sharding_indexed" for c in s["configuration"]["codecs"]]
    assert "zstd" in [c["name"] for c in codecs + inner]
    assert sum(f.stat().st_size for f in (tmp_path / "c" / "z").glob("c*")) < 256 * 64 * 4 // 100
    back = {k: torch.ones_like(v) for k, v in sd.items()}
    dcp.load(back, storage_reader=tsckpt.TensorStoreReader(tmp_path / "c", _extension_registry=None))
    _assert_same(back, sd)


def test_other_extensions_and_safetensors_are_refused_by_name():
    with pytest.raises(tsckpt.TsckptError, match="cannot honour Rot13 .*'stream.rot13'"):
        tsckpt.TensorStoreWriter("x", _extensions=[Rot13()])
    with pytest.raises(tsckpt.TsckptError, match="serialization_format=.*not safetensors"):
        tsckpt.TensorStoreWriter("x", serialization_format=SerializationFormat.SAFETENSORS)
    assert tsckpt.TensorStoreWriter("x", _extensions=[]).array_options.compression is None


def test_cache_staged_state_dict_refills_the_same_copies_for_dcp_async_save(tmp_path):
    from torch.distributed.checkpoint.staging import AsyncStager

    writer = tsckpt.TensorStoreWriter(cache_staged_state_dict=True)
    assert isinstance(writer, AsyncStager)  # dcp.async_save stages with the writer, as with FileSystemWriter
    sd = _sd()
    first = writer.stage(sd)
    sd["w"].add_(1)
    second = writer.stage(sd)
    assert second["w"] is first["w"] and torch.equal(second["w"], sd["w"])  # refilled, not reallocated
    assert second["w"].data_ptr() != sd["w"].data_ptr()
    assert pickle.loads(pickle.dumps(writer))._staged is None  # process-mode async_save never ships the copies
    changed = writer.stage({"w": torch.zeros(2)})  # another structure: fresh copies
    assert changed["w"] is not first["w"]
    assert tsckpt.TensorStoreWriter().stage(sd)["w"] is not tsckpt.TensorStoreWriter().stage(sd)["w"]

    for step in range(2):
        sd["w"].add_(step)
        dcp.async_save(sd, storage_writer=writer, checkpoint_id=tmp_path / str(step)).result()
        _assert_same(_load(tmp_path / str(step)), sd)


def test_per_thread_copy_ahead_bounds_the_bytes_in_flight():
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "memory"}}, create=True, dtype=ts.float32,
                  shape=[8, 1024]).result()
    finished = []
    window = CopyWindow(3 * 4096)
    for i in range(8):
        window.admit(4096)
        copy = torch.full((1024,), float(i))
        fut = arr[i].write(copy.numpy())
        window.add(4096, lambda i=i, fut=fut: (fut.result(), finished.append(f"t{i}")), hold=copy)
        assert window.bytes <= 3 * 4096
    assert finished == [f"t{i}" for i in range(5)]  # waited for the oldest writes, in order
    window.drain()
    assert finished == [f"t{i}" for i in range(8)] and window.bytes == 0
    assert np.array_equal(arr.read().result(), np.repeat(np.arange(8, dtype=np.float32), 1024).reshape(8, 1024))
    unbounded = CopyWindow(None)
    for i in range(4):
        unbounded.admit(1 << 30)
        unbounded.add(1 << 30, lambda: finished.append("big"))
    assert len(finished) == 8 and unbounded.bytes == 4 << 30
    for bad in (-1, 1.5, True):
        with pytest.raises(tsckpt.TsckptError, match=f"per_thread_copy_ahead={bad!r}"):
            tsckpt.TensorStoreWriter("x", per_thread_copy_ahead=bad)
        with pytest.raises(tsckpt.TsckptError, match=f"per_thread_copy_ahead={bad!r}"):
            tsckpt.TensorStoreReader("x", per_thread_copy_ahead=bad)
    assert tsckpt.TensorStoreReader("x").per_thread_copy_ahead == DEFAULT_COPY_AHEAD


@pytest.mark.parametrize("ahead", [0, 4096, None])
def test_loads_through_host_buffers_with_any_copy_ahead(tmp_path, ahead):
    # A dtype cast reads into a host buffer first, as a GPU destination does.
    sd = {f"t{i}": expected(f"t{i}", (64, 16 + i), torch.float32) for i in range(6)}
    tsckpt.save(sd, tmp_path / "c")
    back = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in sd.items()}
    tsckpt.load(back, tmp_path / "c", allow_dtype_cast=True, per_thread_copy_ahead=ahead)
    assert all(torch.equal(back[k], v.double()) for k, v in sd.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies ahead only matter for device tensors")
@pytest.mark.parametrize("ahead", [0, 1 << 16, None])
def test_device_tensors_save_and_load_with_any_copy_ahead(tmp_path, ahead):
    sd = {f"t{i}": expected(f"t{i}", (64, 64), torch.float32).cuda() for i in range(6)}
    dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(tmp_path / "c", per_thread_copy_ahead=ahead))
    back = {k: torch.zeros(64, 64) for k in sd}
    dcp.load(back, storage_reader=tsckpt.TensorStoreReader(tmp_path / "c"))
    assert all(torch.equal(back[k], v.cpu()) for k, v in sd.items())
    on_device = {k: torch.zeros(64, 64, device="cuda") for k in sd}
    dcp.load(on_device, storage_reader=tsckpt.TensorStoreReader(tmp_path / "c", per_thread_copy_ahead=ahead))
    assert all(torch.equal(on_device[k], v) for k, v in sd.items())


# --- overwrite, storage_meta, requires_grad, values --------------------------------------


def test_overwrite_defaults_to_true_like_dcp_and_refusals_say_checkpoint_already_exists(tmp_path):
    path = tmp_path / "c"
    dcp.save({"w": torch.zeros(3)}, storage_writer=tsckpt.TensorStoreWriter(path))
    dcp.save({"w": torch.ones(3)}, storage_writer=tsckpt.TensorStoreWriter(path))
    back = {"w": torch.zeros(3)}
    dcp.load(back, storage_reader=tsckpt.TensorStoreReader(path))
    assert torch.equal(back["w"], torch.ones(3))
    with pytest.raises(BaseException, match="Checkpoint already exists"):
        dcp.save({"w": torch.ones(3)}, storage_writer=tsckpt.TensorStoreWriter(path, overwrite=False))
    with pytest.raises(tsckpt.CheckpointExistsError, match="Checkpoint already exists"):
        tsckpt.save({"w": torch.ones(3)}, path)  # tsckpt's own API keeps refusing by default


def test_storage_meta_reports_the_save_being_made(tmp_path):
    writer = tsckpt.TensorStoreWriter()
    seen = []

    class Planner(DefaultSavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            seen.append(storage_meta.save_id)
            super().set_up_planner(state_dict, storage_meta, is_coordinator)

    for name in ("a", "b"):
        dcp.save({"w": torch.zeros(2)}, storage_writer=writer, planner=Planner(), checkpoint_id=tmp_path / name)
        assert seen[-1] == _doc(tmp_path / name)["extra"]["save_id"]
    assert seen[0] != seen[1] and all(seen)


def test_loading_into_tensors_that_require_grad(tmp_path):
    model = torch.nn.Linear(4, 3)
    tsckpt.save(model.state_dict(), tmp_path / "c")
    other = torch.nn.Linear(4, 3)
    sd = dict(other.named_parameters())  # leaves that require grad, as some trainers pass them
    dcp.load(sd, storage_reader=tsckpt.TensorStoreReader(tmp_path / "c"))
    assert torch.equal(other.weight, model.weight) and other.weight.requires_grad
    other2 = torch.nn.Linear(4, 3)
    tsckpt.load(dict(other2.named_parameters()), tmp_path / "c")
    assert torch.equal(other2.bias, model.bias)


def test_default_planner_stores_plain_values_as_json(tmp_path):
    sd = _sd() | {"custom": torch.Size([2, 3]), "tensors": [torch.arange(3)]}
    dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(tmp_path / "c"))
    objects = _doc(tmp_path / "c")["objects"]
    assert {k: v["encoding"] for k, v in objects.items()} == {
        "step": "json", "lr": "json", "names": "json", "betas": "json", "custom": "torch"}
    assert objects["step"]["value"] == 7 and objects["betas"]["value"] == {"$tuple": [0.9, 0.99]}
    back = _load(tmp_path / "c")
    _assert_same(back, _sd())


# --- DCP plan caching --------------------------------------------------------------------


@pytest.mark.parametrize("planner", [DefaultSavePlanner, tsckpt.SavePlanner])
def test_plan_caching_saves_twice_into_new_directories(tmp_path, planner):
    for step in range(3):
        sd = {k: v + step if isinstance(v, torch.Tensor) else v for k, v in _sd().items()}
        dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(tmp_path / str(step)),
                 planner=planner(enable_plan_caching=True))
        if step == 1:  # a save that does not cache, between two that do, leaves the cache usable
            dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(tmp_path / "plain"), planner=planner())
    for step in range(3):
        expect = {k: v + step if isinstance(v, torch.Tensor) else v for k, v in _sd().items()}
        assert set(_doc(tmp_path / str(step))["tensors"]) == {"w", "h"}
        _assert_same(_load(tmp_path / str(step)), expect)


class _CachingA(tsckpt.SavePlanner):
    """Two planner classes: DCP keeps one plan cache per class."""


class _CachingB(tsckpt.SavePlanner):
    pass


def test_two_caching_planners_in_turn_each_get_their_own_plans(tmp_path):
    """A save whose plans DCP found unchanged gets its own planner's cached plans, not the other planner's."""
    first = {"w": expected("w", (6, 4), torch.float32), "step": 1}
    second = {"v": expected("v", (3, 5), torch.bfloat16), "h": expected("h", (9,), torch.float32)}
    for round_ in range(3):
        for name, sd, planner in (("a", first, _CachingA), ("b", second, _CachingB)):
            dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(tmp_path / f"{name}{round_}",
                                                                 compression="zstd" if round_ == 2 else None),
                     planner=planner(enable_plan_caching=True))
    for round_ in range(3):
        for name, sd in (("a", first), ("b", second)):
            doc = _doc(tmp_path / f"{name}{round_}")
            assert set(doc["tensors"]) == {k for k, v in sd.items() if isinstance(v, torch.Tensor)}, (name, round_)
            assert doc["array_options"]["compression"] == ("zstd" if round_ == 2 else None)
            back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
            dcp.load(back, storage_reader=tsckpt.TensorStoreReader(tmp_path / f"{name}{round_}"))
            for k, v in sd.items():
                assert same_bits(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v, (name, round_, k)


def test_dcps_caching_planner_gets_what_its_cache_holds_not_the_last_saves_plans(tmp_path):
    """DCP's planner says nothing about its cache: the writer recalls the plans DCP's cache still holds (noted
    from the planner's global_plan after each save), not those of a save between that did not cache."""
    other = {"x": expected("x", (7,), torch.float32), "step": 1}
    for step in range(3):
        sd = {k: v + step if isinstance(v, torch.Tensor) else v for k, v in _sd().items()}
        dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(tmp_path / f"c{step}"),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        dcp.save(other, storage_writer=tsckpt.TensorStoreWriter(tmp_path / f"o{step}"), planner=DefaultSavePlanner())
    for step in range(3):
        assert set(_doc(tmp_path / f"c{step}")["tensors"]) == {"w", "h"}
        _assert_same(_load(tmp_path / f"c{step}"),
                     {k: v + step if isinstance(v, torch.Tensor) else v for k, v in _sd().items()})
        assert set(_doc(tmp_path / f"o{step}")["tensors"]) == {"x"}


class _DcpCachingA(DefaultSavePlanner):
    """Two of DCP's planner classes: DCP keeps one plan cache per class, and says which to nobody."""


class _DcpCachingB(DefaultSavePlanner):
    pass


def _two_dcp_caching_classes(rank, world, path):
    first, second = {"w": torch.ones(4)}, {"v": torch.ones(3), "u": torch.zeros(2)}
    for name, sd, planner in (("a0", first, _DcpCachingA), ("b0", second, _DcpCachingB)):
        dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(f"{path}/{name}"), planner=planner(enable_plan_caching=True))
    try:
        dcp.save(first, storage_writer=tsckpt.TensorStoreWriter(f"{path}/a1"),
                 planner=_DcpCachingA(enable_plan_caching=True))
    except BaseException as e:  # DCP's CheckpointException
        return str(e)
    return None


def test_two_of_dcps_caching_planner_classes_in_one_process_are_refused_not_guessed(tmp_path):
    # In a process of its own: DCP's plan caches are class attributes that outlive the test.
    refusal = run_ranks(1, _two_dcp_caching_classes, str(tmp_path))[0]
    assert refusal is not None and "use tsckpt.SavePlanner" in refusal
    assert not (tmp_path / "a1" / "zarr.json").exists()


def test_a_prepickled_plan_is_a_plan_with_its_pickled_items_as_a_field():
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
    from torch.distributed.checkpoint.planner import SavePlan

    from tsckpt.dcp.contract import Prepickled
    from tsckpt.dcp.plan_cache import PrepickledPlan

    plan = create_default_local_save_plan({"w": torch.ones(2, 3), "step": 1}, True)
    sent = PrepickledPlan.of(plan, Prepickled(SavePlan(plan.items, planner_data=plan.planner_data)), "orders")
    assert set(vars(sent)) == {f.name for f in dataclasses.fields(sent)}  # nothing set beside its fields
    back = pickle.loads(pickle.dumps(sent))
    assert type(back) is SavePlan and back.items == plan.items and back.storage_data == "orders"
    changed = pickle.loads(pickle.dumps(dataclasses.replace(sent, items=plan.items[:1])))
    assert changed.items == plan.items[:1] and changed.storage_data == "orders"  # not the bytes pickled before


# --- logging and warnings --------------------------------------------------------------


def test_one_info_line_per_save_and_load_and_none_by_default(tmp_path, caplog, capfd):
    sd = _sd()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "torch.distributed is disabled" from tsckpt's own calls
        tsckpt.save(sd, tmp_path / "quiet")
        tsckpt.load({"w": torch.zeros(6, 4)}, tmp_path / "quiet", allow_partial_load=True)
    assert capfd.readouterr().err == ""  # logging is off until the application turns it on

    with caplog.at_level(logging.INFO, logger="tsckpt"):
        tsckpt.save(sd, tmp_path / "c")
        dcp.load({"w": torch.zeros(6, 4)}, storage_reader=tsckpt.TensorStoreReader(tmp_path / "c"))
    lines = [r for r in caplog.records if r.name == "tsckpt"]
    assert [r.tsckpt["op"] for r in lines] == ["saved", "loaded"]
    saved, loaded = (r.tsckpt for r in lines)
    assert saved["bytes"] == 6 * 4 * 4 + 5 * 2 and loaded["bytes"] == 6 * 4 * 4
    # 2 chunk files, 2 array nodes and the root written; 1 chunk file, its node and the root read
    assert (saved["files"], loaded["files"]) == (5, 3) and saved["ranks"] == loaded["ranks"] == 1
    assert lines[0].getMessage().startswith(f"saved 106 bytes to {tmp_path / 'c'} in ")
    assert "GB/s), 5 files, 1 rank" in lines[0].getMessage()


def test_dcp_save_with_use_collectives_false_in_one_process_works(tmp_path):
    dcp.save(_sd(), storage_writer=tsckpt.TensorStoreWriter(tmp_path / "c"), use_collectives=False)
    _assert_same(_load(tmp_path / "c"), _sd())


# --- real ranks -------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.tsckpt)


def _dist_sd(rank: int, world: int, step: int = 0) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"model": {"w": distribute_tensor(expected("w", (8, 6), torch.float32) + step, mesh, [Shard(0)]),
                      "b": distribute_tensor(expected("b", (5,), torch.float32), mesh, [Replicate()])},
            "step": 7 + step, "names": ["a", "b"]}


def dropin_on_ranks(rank, world, path):
    """dcp.save/async_save/load with DCP's planners, plan caching and use_collectives=False on gloo ranks."""
    handler = _Records()
    log = logging.getLogger("tsckpt")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    sd = _dist_sd(rank, world)
    dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(f"{path}/sync"))
    dcp.async_save(sd, storage_writer=tsckpt.TensorStoreWriter(f"{path}/async")).result()
    back = _dist_sd(rank, world, step=100)
    dcp.load(back, storage_reader=tsckpt.TensorStoreReader(f"{path}/sync"))
    loaded_ok = all(torch.equal(back["model"][k].to_local(), sd["model"][k].to_local()) for k in ("w", "b"))
    for step in range(3):
        state = _dist_sd(rank, world, step)
        if step == 2 and rank == 1:
            state["only_on_1"] = torch.arange(4.0)  # rank 1's plan changes, rank 0's stays cached
        dcp.save(state, storage_writer=tsckpt.TensorStoreWriter(f"{path}/cached{step}"),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        # tsckpt's planner, caching too: a repeated save sends each rank only the new save's orders.
        dcp.save(state, storage_writer=tsckpt.TensorStoreWriter(f"{path}/tcached{step}"),
                 planner=tsckpt.SavePlanner(enable_plan_caching=True))
    stager = tsckpt.TensorStoreWriter(cache_staged_state_dict=True)
    first = stager.stage(_dist_sd(rank, world, 0))
    second = stager.stage(_dist_sd(rank, world, 5))
    refilled = second["model"]["w"] is first["model"]["w"] and torch.equal(
        second["model"]["w"].to_local(), _dist_sd(rank, world, 5)["model"]["w"].to_local())
    try:
        dcp.save(sd, storage_writer=tsckpt.TensorStoreWriter(f"{path}/local"), use_collectives=False)
        refusal = None
    except Exception as e:
        refusal = str(e)
    dist.barrier()
    log.removeHandler(handler)
    return {"lines": handler.lines, "loaded_ok": loaded_ok, "refusal": refusal, "refilled": refilled}


@pytest.fixture(scope="module")
def dropin_run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dropin"))
    return path, run_ranks(2, dropin_on_ranks, path)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_default_planner_records_placements_and_json_values_on_ranks(dropin_run, mode):
    """DCP's planner puts no placements in its plans: each rank reports those it describes in its summary."""
    path, _ = dropin_run
    doc = _doc(f"{path}/{mode}")
    assert doc["meshes"] == [{"shape": [2], "dim_names": None, "device_type": "cpu", "ranks": [0, 1]}]
    assert doc["tensors"]["model.w"]["placement"] == {"kind": "dtensor", "mesh": 0,
                                                      "placements": [{"type": "shard", "dim": 0}]}
    assert doc["tensors"]["model.b"]["placement"]["placements"] == [{"type": "replicate"}]
    assert {k: v["encoding"] for k, v in doc["objects"].items()} == {"step": "json", "names": "json"}
    info = CliRunner().invoke(app, ["info", f"{path}/{mode}"], env={"COLUMNS": "200"})
    assert info.exit_code == 0 and "no DTensors" not in info.output and "ranks [0, 1]" in info.output


def test_loads_on_ranks_and_logs_once_per_save_and_load_on_the_coordinator(dropin_run):
    path, results = dropin_run
    assert all(r["loaded_ok"] for r in results)
    assert results[1]["lines"] == []
    ops = [(line["op"], os.path.basename(line["path"])) for line in results[0]["lines"]]
    assert ops == [("saved", "sync"), ("saved", "async"), ("loaded", "sync"),
                   ("saved", "cached0"), ("saved", "tcached0"), ("saved", "cached1"), ("saved", "tcached1"),
                   ("saved", "cached2"), ("saved", "tcached2")]
    first = results[0]["lines"][0]
    assert first["ranks"] == 2 and first["bytes"] == 8 * 6 * 4 + 5 * 4


@pytest.mark.parametrize("series", ["cached", "tcached"])
def test_plan_caching_on_ranks_commits_every_tensor(dropin_run, series):
    path, _ = dropin_run
    for step in range(3):
        names = {"model.w", "model.b"} | ({"only_on_1"} if step == 2 else set())
        assert set(_doc(f"{path}/{series}{step}")["tensors"]) == names, step
        back = {"model": {"w": torch.zeros(8, 6), "b": torch.zeros(5)}, "step": 0, "names": []}
        dcp.load(back, storage_reader=tsckpt.TensorStoreReader(f"{path}/{series}{step}"))
        assert same_bits(back["model"]["w"], expected("w", (8, 6), torch.float32) + step), step
        assert back["step"] == 7 + step


def test_cached_staging_refills_dtensors_on_ranks(dropin_run):
    assert all(r["refilled"] for r in dropin_run[1])


def test_rank_local_saves_are_refused_up_front(dropin_run):
    path, results = dropin_run
    for r in results:
        assert "use_collectives=False on 2 ranks" in r["refusal"]
    assert not os.path.exists(f"{path}/local/zarr.json")
