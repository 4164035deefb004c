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
