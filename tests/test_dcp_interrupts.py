"""Ctrl-C or a failure during ``dcp.save``/``dcp.async_save`` with tsckpt's writer: cleaned up, said once.

The same mechanism as ``tsckpt.save``: a rank stopped by Ctrl-C (a real
SIGINT, :mod:`ctrl_c`) or by an error waits for its writes and reports it to
the coordinator, whose ``finish`` removes what the save staged (the hidden
staging directory beside a local target; the objects written in place on S3)
and raises one line. DCP raises that one line on every rank, inside its
``CheckpointException``: no rank's raw ``KeyboardInterrupt``, no gloo error.
Ctrl-C while the coordinator commits waits for the commit, and the line says
the checkpoint is complete.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

import dist
import tsckpt
from ctrl_c import ARMED, CtrlC
from tsckpt.commit.protocol import leftovers

BUCKET = "tsckpt-dcp-interrupts"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)
WORLD = 2


class Unpicklable:
    """A value that fails as the rank's writer pickles it, not before: ``async_save`` stages it as it is."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise RuntimeError("this value cannot be pickled")


def _state(rank: int, stop: str) -> dict:
    # Chunk files of 1 MiB and more go through the write threads: still being written when the rank stops.
    state = {f"w{i}": torch.full((256, 1024), float(i)) for i in range(4)}
    if rank == 1 and stop == "ctrl-c":
        state["z1"] = CtrlC()  # last: the tensors' writes are under way when it is pickled
    if rank == 1 and stop == "error":
        state["z1"] = Unpicklable()
    return state


def _commit_interrupted(frame, event, arg) -> None:
    """Profiler of the coordinator: Ctrl-C as its commit publishes the root document."""
    if event == "call" and frame.f_code.co_name == "commit_root" and "/tsckpt/commit/" in frame.f_code.co_filename:
        sys.setprofile(None)
        signal.raise_signal(signal.SIGINT)


def _save(rank: int, world: int, location, api: str, stop: str) -> tuple[str, str]:
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp

    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ[ARMED] = "1"
    state = _state(rank, stop)
    if rank == 0 and stop == "ctrl-c-at-commit":
        sys.setprofile(_commit_interrupted)
    try:
        if api == "dcp":
            dcp.save(state, storage_writer=tsckpt.TensorStoreWriter(location))
        elif api == "dcp-async":
            group = tdist.new_group(backend="gloo")  # async saves talk in a group of their own on CPU
            dcp.async_save(state, storage_writer=tsckpt.TensorStoreWriter(location), process_group=group).result()
        else:
            tsckpt.save(state, location, overwrite=True)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException and KeyboardInterrupt are outcomes here
        return type(e).__name__, str(e)
    finally:
        sys.setprofile(None)
    return "ok", ""


class Local:
    def __init__(self, tmp_path):
        self.parent = tmp_path / "run"
        self.parent.mkdir()
        self.location = self.url = str(self.parent / "step_1")

    def left(self) -> list[str]:
        """What the run directory holds: the checkpoint, staging directories, moved-aside trees."""
        return sorted(os.listdir(self.parent))


class S3:
    def __init__(self, server, name: str):
        self.server, self.prefix = server, f"{name}/step_1"
        self.location = server.location(BUCKET, self.prefix)
        self.url = f"s3://{BUCKET}/{self.prefix}"

    def left(self) -> list[str]:
        return self.server.keys(BUCKET, f"{self.prefix}/")


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    if request.param == "local":
        return Local(tmp_path)
    return S3(request.getfixturevalue("s3"), tmp_path.name)


def _dcp_line(message: str) -> list[str]:
    return [line for line in message.splitlines() if line.startswith("tsckpt.errors.")]


def test_ctrl_c_during_dcp_save_removes_what_it_staged_and_says_so_once(where):
    # Not dcp.async_save's thread: Ctrl-C interrupts the main thread only, where training goes on.
    results = dist.run_ranks(WORLD, _save, where.location, "dcp", "ctrl-c", timeout=180)
    line = (f"save to {where.url} was interrupted (Ctrl-C on rank 1); nothing was committed; "
            f"what it had staged was removed")
    for kind, message in results:
        # One failure, the coordinator's line, on every rank: no rank's KeyboardInterrupt, no gloo error.
        assert kind == "CheckpointException", message
        assert _dcp_line(message) == [f"tsckpt.errors.SaveFailedError: {line}"], message
        assert "KeyboardInterrupt" not in message and "gloo" not in message, message
    assert where.left() == []


@pytest.mark.parametrize("api", ["dcp", "dcp-async"])
def test_a_failure_during_dcp_save_removes_what_it_staged_and_says_so_once(where, api):
    results = dist.run_ranks(WORLD, _save, where.location, api, "error", timeout=180)
    for kind, message in results:
        assert kind == "CheckpointException", message
        [error] = _dcp_line(message)
        assert error.startswith(f"tsckpt.errors.SaveFailedError: save to {where.url} failed on rank 1: "
                                f"RuntimeError: this value cannot be pickled"), message
        assert message.rstrip().endswith("nothing was committed; what the save had written was removed"), message
    assert where.left() == []


@pytest.mark.parametrize("api", ["dcp", "tsckpt"])
def test_ctrl_c_during_the_commit_waits_for_it_and_says_the_checkpoint_is_complete(where, api):
    results = dist.run_ranks(WORLD, _save, where.location, api, "ctrl-c-at-commit", timeout=180)
    line = f"save to {where.url} was interrupted (Ctrl-C on rank 0); it had committed: {where.url} is complete"
    if api == "dcp":
        for kind, message in results:
            assert kind == "CheckpointException" and _dcp_line(message) == [
                f"tsckpt.errors.SaveFailedError: {line}"], message
    else:
        assert results == [("KeyboardInterrupt", line), ("SaveFailedError", line)], results
    back = {f"w{i}": torch.zeros(256, 1024) for i in range(4)}
    tsckpt.load(back, where.location)
    assert all(torch.equal(back[f"w{i}"], torch.full((256, 1024), float(i))) for i in range(4))
    assert leftovers(where.location) == []  # no staging directory, no claim
