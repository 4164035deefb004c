"""The cycle collector is held off while a rank moves a checkpoint's pieces, and put back as it was."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from damage import edit_key, flip_byte

import tsckpt
from tsckpt.dcp import collector


def test_the_collector_is_held_off_inside_and_restored_as_it_was_after_every_caller_is_out():
    assert gc.isenabled()
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with collector.held_off():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    with collector.held_off():
        assert not gc.isenabled()
        thread.start()
        entered.wait(10)
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    thread.join(10)
    assert gc.isenabled()
    gc.disable()
    try:
        with collector.held_off():
            pass
        assert not gc.isenabled()  # disabled by its owner before: left so
    finally:
        gc.enable()


def test_a_load_leaves_the_collector_on_even_when_its_reads_fail(tmp_path):
    tsckpt.save({"w": torch.arange(6.0)}, tmp_path / "ck")
    sd = {"w": torch.zeros(6)}
    tsckpt.load(sd, tmp_path / "ck")
    assert torch.equal(sd["w"], torch.arange(6.0)) and gc.isenabled()
    edit_key(tmp_path / "ck", "w/c.0", lambda data: flip_byte(data, 4, 0x10))
    with pytest.raises(tsckpt.ChecksumError):
        tsckpt.load(sd, tmp_path / "ck")
    assert gc.isenabled()


def test_a_caller_can_leave_the_collector_alone(monkeypatch, tmp_path):
    monkeypatch.setenv(collector.HOLD_ENV, "0")
    with collector.held_off():
        assert gc.isenabled()
    monkeypatch.delenv(collector.HOLD_ENV)
    monkeypatch.setattr(collector, "hold", False)
    seen = []

    class Watching(tsckpt.LoadPlanner):
        def create_local_plan(self):
            seen.append(gc.isenabled())
            return super().create_local_plan()

    tsckpt.save({"w": torch.arange(6.0)}, tmp_path / "ck")
    reader = tsckpt.TensorStoreReader(tmp_path / "ck")
    import torch.distributed.checkpoint as dcp

    dcp.load({"w": torch.zeros(6)}, storage_reader=reader, planner=Watching())
    assert seen == [True]


@pytest.mark.parametrize("where", ["file", "memory"])
def test_a_load_leaves_no_tensorstore_object_for_the_collector_to_free(where, tmp_path):
    # What a load leaves in a reference cycle is freed only by a collection, which at exit may run while
    # TensorStore's threads can no longer take the GIL: nothing of it may hold a TensorStore object.
    path = str(tmp_path / "ck") if where == "file" else f"memory://collector-{tmp_path.name}/ck"
    state = {"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(4, dtype=torch.bfloat16), "step": 3}
    tsckpt.save(state, path)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        out = {"w": torch.zeros(8, 8), "b": torch.zeros(4, dtype=torch.bfloat16), "step": 0}
        tsckpt.load(out, path)
        del out
        gc.collect()
        kept = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                       if (type(o).__module__ or "").startswith(("tensorstore", "tsckpt.storage"))})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert kept == []
