"""Atomic commit: a save that dies at any point never yields a checkpoint that loads.

Each death is real: a rank SIGKILLs itself while writing, raises, the
coordinator dies before or exactly at the commit write, or the disk fills up.
Afterwards nothing of the dead save is at its location (it wrote into a staging
directory beside it), every reader refuses the location, an overwritten
checkpoint still loads bit-exactly, and the next save removes the dead save's
staging directory.
"""

from __future__ import annotations

import importlib.util
import dataclasses
import os
import signal
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dist
import tsckpt
from tsckpt.commit import protocol as commit
from tsckpt.commit.staging_dirs import staging_dirs
from tsckpt.storage.layouts import default_layout
from tsckpt.errors import CheckpointExistsError, CheckpointNotFoundError, IncompleteCheckpointError, MetadataError
from tsckpt.dcp.planner import SavePlanner
from tsckpt.dcp.storage import TensorStoreWriter
from tsckpt.read.verify import verify

TIMEOUT = 180  # a hung rank fails the test instead of blocking the suite


def _globals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(8, 4, generator=g).to(torch.bfloat16), "b": torch.randn(5, generator=g)}


def _state(world: int) -> dict:
    """A DTensor row-sharded over every rank, a replicated tensor and a plain value."""
    e = _globals()
    if world == 1 and not torch.distributed.is_initialized():
        return {"model": {"w": e["w"].clone(), "b": e["b"].clone()}, "lr": 0.25}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"model": {"w": distribute_tensor(e["w"], mesh, [Shard(0)], src_data_rank=None),
                      "b": e["b"].clone()}, "lr": 0.25}


def _empty() -> dict:
    return {"model": {"w": torch.zeros(8, 4, dtype=torch.bfloat16), "b": torch.zeros(5)}, "lr": None}


def _assert_bit_exact(path) -> None:
    sd = _empty()
    tsckpt.load(sd, path)
    e = _globals()
    assert torch.equal(sd["model"]["w"].view(torch.int16), e["w"].view(torch.int16))
    assert torch.equal(sd["model"]["b"].view(torch.int32), e["b"].view(torch.int32))
    assert sd["lr"] == 0.25


def _assert_refused(path, error=CheckpointNotFoundError, text="no checkpoint at") -> None:
    """Every way in refuses the location: by default, nothing was published there."""
    with pytest.raises(error, match=text):
        tsckpt.load(_empty(), path)
    # Raw dcp.load catches read_metadata's exception and re-raises only its text
    # (inside a CheckpointException), so the class is lost there but the reason is not.
    with pytest.raises(CheckpointException, match=text):
        dcp.load(_empty(), storage_reader=tsckpt.TensorStoreReader(path))
    with pytest.raises(error):
        verify(path)
    if importlib.util.find_spec("tsckpt.read.checkpoint") is not None:
        with pytest.raises(error):
            tsckpt.open(path)


def _dead_staging(path) -> list:
    return [d for d in staging_dirs(str(path)) if not d.old]


# --- fault injection, run inside spawned ranks ------------------------------------------------

class _KillingPlanner(SavePlanner):
    """Kills (or fails) one rank after it has started writing its data."""

    def __init__(self, victim: int, how: str):
        super().__init__()
        self.victim, self.how, self.calls = victim, how, 0

    def resolve_data(self, write_item):
        self.calls += 1
        if torch.distributed.get_rank() == self.victim and self.calls == 2:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure while writing")
        return super().resolve_data(write_item)


class _RootKiller:
    """A kvstore that dies exactly when asked to write the root document (the commit)."""

    def __init__(self, kv):
        self._kv = kv

    def write(self, key, value):
        if key == commit.ROOT:
            os.kill(os.getpid(), signal.SIGKILL)
        return self._kv.write(key, value)

    def __getattr__(self, name):  # everything else is the kvstore's own (its spec, reads, lists)
        return getattr(self._kv, name)


class _DyingWriter(TensorStoreWriter):
    """The coordinator dies before committing ('finish') or at the commit write ('root')."""

    def __init__(self, *args, die_at: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.die_at = die_at

    def finish(self, metadata, results):
        if self.die_at == "finish":
            os.kill(os.getpid(), signal.SIGKILL)
        real = commit.commit
        commit.commit = lambda store, *a, **kw: real(
            dataclasses.replace(store, kvstore=_RootKiller(store.kvstore)), *a, **kw)
        try:
            super().finish(metadata, results)
        finally:
            commit.commit = real


def _save(rank, world, path, overwrite=False):
    tsckpt.save(_state(world), path, overwrite=overwrite)


def _save_killed(rank, world, path, victim, how, overwrite=False):
    dcp.save(_state(world), storage_writer=TensorStoreWriter(path, overwrite=overwrite),
             planner=_KillingPlanner(victim, how))


def _save_coordinator_dies(rank, world, path, die_at, overwrite=False):
    dcp.save(_state(world), storage_writer=_DyingWriter(path, die_at=die_at, overwrite=overwrite),
             planner=SavePlanner())


@pytest.fixture
def previous(tmp_path):
    path = tmp_path / "previous"
    tsckpt.save(_state(1), path)
    return path


# --- tests ------------------------------------------------------------------------------------

def test_rank_killed_mid_write_leaves_nothing_loadable(tmp_path, previous):
    new = tmp_path / "new"
    with pytest.raises(AssertionError):
        dist.run_ranks(2, _save_killed, new, 1, "kill", timeout=TIMEOUT)
    assert not new.exists()
    [staged] = _dead_staging(new)  # the save did get as far as writing data, beside the target
    if default_layout() == "plain":  # a packed rank's batch may die before its one commit
        assert any(f.startswith("c") for _, _, files in os.walk(staged.path) for f in files)
    _assert_refused(new, text="leftover staging")
    _assert_bit_exact(previous)


def test_exception_in_one_rank_fails_every_rank(tmp_path, previous):
    new = tmp_path / "new"
    with pytest.raises(AssertionError) as info:
        dist.run_ranks(2, _save_killed, new, 1, "raise", timeout=TIMEOUT)
    text = str(info.value)
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text
    assert f"save to {new} failed on rank 1: RuntimeError: injected failure while writing" in text
    assert not staging_dirs(str(new))  # what rank 0 wrote went with the failed save
    _assert_refused(new)
    _assert_bit_exact(previous)


@pytest.mark.parametrize("die_at", ["finish", "root"])
def test_coordinator_dying_before_commit(tmp_path, previous, die_at):
    new = tmp_path / "new"
    with pytest.raises(AssertionError):
        dist.run_ranks(1, _save_coordinator_dies, new, die_at, timeout=TIMEOUT)
    [staged] = _dead_staging(new)
    if die_at == "root":
        # Everything but the commit made it to disk: array nodes exist, the root does not.
        node = "model/w/zarr.json" if default_layout() == "plain" else "manifest.ocdbt"
        assert os.path.isfile(os.path.join(staged.path, node))
        assert not os.path.exists(os.path.join(staged.path, "zarr.json"))
    assert not new.exists()
    _assert_refused(new)
    _assert_bit_exact(previous)
    # The location takes a fresh save (no overwrite needed: nothing was committed),
    # which removes the dead save's staging directory.
    tsckpt.save(_state(1), new)
    _assert_bit_exact(new)
    assert verify(new).ok
    assert not staging_dirs(str(new))


def test_saving_over_a_complete_checkpoint_needs_overwrite(previous):
    with pytest.raises(CheckpointExistsError, match="Checkpoint already exists.*overwrite=True"):
        tsckpt.save(_state(1), previous)
    _assert_bit_exact(previous)
    changed = _state(1)
    changed["lr"] = 0.5
    tsckpt.save(changed, previous, overwrite=True)
    sd = _empty()
    tsckpt.load(sd, previous)
    assert sd["lr"] == 0.5


@pytest.mark.parametrize("death", ["write", "root"])
def test_dying_overwrite_keeps_the_old_checkpoint(previous, death):
    if death == "write":
        run = (_save_killed, previous, 0, "kill", True)
    else:
        run = (_save_coordinator_dies, previous, "root", True)
    with pytest.raises(AssertionError):
        dist.run_ranks(1, *run, timeout=TIMEOUT)
    # The new save wrote only into its staging directory: the old checkpoint is untouched.
    _assert_bit_exact(previous)
    assert verify(previous).ok
    assert len(_dead_staging(previous)) == 1


# --- faults from the filesystem ---------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()}); "
                    "test_unwritable_location_fails_every_rank covers a real write fault instead")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _save_big(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    big = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)  # 2 MiB: 1 MiB per rank
    tsckpt.save({"big": distribute_tensor(big, mesh, [Shard(0)], src_data_rank=None)}, path)


def test_disk_full_fails_every_rank_and_commits_nothing(small_disk):
    path = small_disk / "ckpt"
    with pytest.raises(AssertionError) as info:
        dist.run_ranks(2, _save_big, path, timeout=TIMEOUT)
    text = str(info.value)
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text
    assert "no space left on device writing 'big'" in text, text[-2000:]  # the error names the tensor
    assert not (path / "zarr.json").exists()
    assert not staging_dirs(str(path))  # the failed save removed what it had staged
    # Incomplete if some chunk fit before the disk filled, empty if none did: never loadable.
    with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)):
        tsckpt.load({"big": torch.zeros(512, 1024)}, path)


def test_unwritable_location_fails_every_rank(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where a directory should be")  # root ignores permissions, not this
    path = blocker / "ckpt"
    with pytest.raises(AssertionError) as info:
        dist.run_ranks(2, _save, path, timeout=TIMEOUT)
    text = str(info.value)
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text
    assert "ckpt" in text
    assert blocker.read_text().startswith("a file")


def test_a_root_document_no_reader_accepts_is_never_committed(tmp_path, monkeypatch):
    """At 10,000 ranks of one-row shards the root outgrows the reader's limit: the save refuses, the old one stays."""
    path = str(tmp_path / "c")
    tsckpt.save({"w": torch.arange(6.0)}, path)
    monkeypatch.setattr(commit, "MAX_DOCUMENT_BYTES", 4000)
    with pytest.raises(MetadataError, match=r"root zarr.json would be about \d+ bytes, more than the 4000 a reader accepts "
                                            r"\(50 tensors, 0 values, 1 ranks\).*nothing was committed"):
        tsckpt.save({f"w{i}": torch.full((8,), float(i)) for i in range(50)}, path, overwrite=True)
    assert not os.path.exists(os.path.join(path, "w0")) and not staging_dirs(path)
    monkeypatch.undo()
    back = {"w": torch.zeros(6)}
    tsckpt.load(back, path)
    assert torch.equal(back["w"], torch.arange(6.0))
