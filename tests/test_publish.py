"""Publication on a local filesystem: overwrites that never lose the old checkpoint, races, refusals, leftovers.

Every save writes into a staging directory beside its target and is published
by one rename (or an atomic exchange with the checkpoint it replaces). Ranks
are real gloo processes forked from a server that imported torch once
(tests/dist.py), killed with real SIGKILLs; nothing about storage is faked.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import threading
import time

import numpy as np
import pytest
import torch
import zarr
from typer.testing import CliRunner

import dist
import tsckpt
from tsckpt.cli import app
from tsckpt.cli import clean as _clean_cmd  # noqa: F401 - registers the commands used below
from tsckpt.cli import inspect as _inspect_cmd  # noqa: F401
from tsckpt.cli import verify as _verify_cmd  # noqa: F401
from tsckpt.dcp.planner import SavePlanner
from tsckpt.dcp.storage import TensorStoreWriter
from tsckpt.errors import CheckpointExistsError, CheckpointNotFoundError, ForeignContentError
from tsckpt.commit.staged import StagedTarget
from tsckpt.commit.staging_dirs import staging_dirs, staging_path

TIMEOUT = 240
TRIALS = 20
WORLD = 4
SAVE_ID = re.compile(r"\b[0-9a-f]{32}\b")


def _values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 8, generator=g), "b": torch.randn(12, generator=g).to(torch.bfloat16)}


def _sharded(seed: int, world: int) -> dict:
    """The tensors of ``seed``: ``w`` row-sharded over every rank, ``b`` replicated, and a step counter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    v = _values(seed)
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(v["w"], mesh, [Shard(0)], src_data_rank=None), "b": v["b"], "step": seed}


def _plain(seed: int) -> dict:
    return {**_values(seed), "step": seed}


def _which(path) -> int | None:
    """The seed whose tensors ``path`` holds bit-exactly, or None if it loads as neither (or not at all)."""
    sd = {"w": torch.zeros(16, 8), "b": torch.zeros(12, dtype=torch.bfloat16), "step": None}
    try:
        tsckpt.load(sd, path)
    except tsckpt.TsckptError:
        return None
    for seed in {sd["step"]} if isinstance(sd["step"], int) else set():
        v = _values(seed)
        if torch.equal(sd["w"].view(torch.int32), v["w"].view(torch.int32)) and \
                torch.equal(sd["b"].view(torch.int16), v["b"].view(torch.int16)):
            return seed
    return None


def _cli(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})


# --- run inside the ranks -----------------------------------------------------------------------

class _KillAfterFirstWrite(SavePlanner):
    """The victim rank SIGKILLs itself ``delay`` seconds after its first write starts.

    Timing from the first write (not from process start) spreads the kills over
    writing, the commit, publication and deletion of the old tree, the part of a
    save where dying could lose or mix checkpoints.
    """

    def __init__(self, victim, delay):
        super().__init__()
        self.victim, self.delay, self.started = victim, delay, None

    def resolve_data(self, write_item):
        if self.started is None:
            self.started = time.monotonic()
            if torch.distributed.get_rank() == self.victim:
                timer = threading.Timer(self.delay, os.kill, (os.getpid(), signal.SIGKILL))
                timer.daemon = True
                timer.start()
        return super().resolve_data(write_item)


def _save_then_maybe_die(rank, world, path, seed, victim, delay):
    """Overwrite ``path`` with ``seed``; returns the seconds from this rank's first write to the end."""
    import torch.distributed.checkpoint as dcp

    planner = _KillAfterFirstWrite(victim, delay)
    dcp.save(_sharded(seed, world), storage_writer=TensorStoreWriter(path, overwrite=True), planner=planner)
    return time.monotonic() - planner.started


class _MeetingPlanner(SavePlanner):
    """Holds rank 0 at its first write until the other save has reached its own writes."""

    def __init__(self, mine, other):
        super().__init__()
        self.mine, self.other, self.met = mine, other, False

    def resolve_data(self, write_item):
        if not self.met and torch.distributed.get_rank() == 0:
            self.met = True
            open(self.mine, "w").close()
            deadline = time.monotonic() + TIMEOUT / 2
            while not os.path.exists(self.other) and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().resolve_data(write_item)


def _save_meeting(rank, world, path, seed, mine, other, overwrite):
    import torch.distributed.checkpoint as dcp

    writer = TensorStoreWriter(path, overwrite=overwrite)
    dcp.save(_sharded(seed, world), storage_writer=writer, planner=_MeetingPlanner(mine, other))
    return writer.save_id if rank == 0 else None


class _DieWhileWriting(SavePlanner):
    def resolve_data(self, write_item):
        if torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(write_item)


def _save_killed(rank, world, path, seed):
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded(seed, world), storage_writer=TensorStoreWriter(path, overwrite=True),
             planner=_DieWhileWriting())


# --- tests --------------------------------------------------------------------------------------

@pytest.mark.timeout(1800)  # 21 four-rank saves: about 1 s each on an idle machine, far more on a busy one
def test_sigkill_at_random_points_of_an_overwrite_leaves_old_or_new(tmp_path, capsys):
    base = tmp_path / "old"
    tsckpt.save(_plain(1), base)
    # One clean run sizes the window in which the kills land (and checks that the new save loads).
    reference = tmp_path / "reference"
    shutil.copytree(base, reference)
    took = max(dist.run_ranks(WORLD, _save_then_maybe_die, reference, 2, -1, 0.0, timeout=TIMEOUT))
    assert _which(reference) == 2
    rng = random.Random(11)
    counts = {"old": 0, "new": 0, "neither": 0}
    for trial in range(TRIALS):
        path = tmp_path / f"trial{trial}"
        shutil.copytree(base, path)
        victim = 0 if trial % 2 == 0 else rng.randrange(1, WORLD)  # half the kills hit the coordinator
        delay = rng.uniform(0.0, 1.3 * took)
        try:
            dist.run_ranks(WORLD, _save_then_maybe_die, path, 2, victim, delay, timeout=TIMEOUT)
        except AssertionError:
            pass
        outcome = {1: "old", 2: "new"}.get(_which(path), "neither")
        counts[outcome] += 1
        left = tsckpt.leftovers(path)
        # Whatever the dead save left is beside the target, never in it, and no save holds it.
        assert all(item.live is False for item in left)
        with capsys.disabled():
            print(f"\ntrial {trial}: rank {victim} killed {delay:.2f}s after its first write -> {outcome}; "
                  f"left: {[item.what for item in left]}", end="")
        assert outcome != "neither", f"trial {trial}: rank {victim} killed after {delay:.2f}s left neither"
    with capsys.disabled():
        print(f"\n{TRIALS} overwrites with a rank SIGKILLed at random (writes to end: {took:.2f}s): {counts}")
    assert counts["neither"] == 0


def _race(tmp_path, overwrite):
    target = tmp_path / "target"
    flags = [str(tmp_path / "a.ready"), str(tmp_path / "b.ready")]
    outcomes: dict[int, object] = {}

    def run(seed, mine, other):
        try:
            outcomes[seed] = dist.run_ranks(2, _save_meeting, target, seed, mine, other, overwrite,
                                            timeout=TIMEOUT)[0]
        except AssertionError as e:
            outcomes[seed] = e

    threads = [threading.Thread(target=run, args=(3, flags[0], flags[1])),
               threading.Thread(target=run, args=(4, flags[1], flags[0]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(os.path.exists(f) for f in flags)  # both saves were writing at the same time
    return target, outcomes


def test_two_concurrent_saves_without_overwrite_exactly_one_commits(tmp_path):
    target, outcomes = _race(tmp_path, overwrite=False)
    won = [seed for seed, o in outcomes.items() if isinstance(o, str)]
    lost = [seed for seed, o in outcomes.items() if isinstance(o, AssertionError)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert _which(target) == won[0]
    message = str(outcomes[lost[0]])
    assert "Checkpoint already exists" in message and "was not published" in message
    # the error's own line: Python 3.13 tracebacks also quote the raising source line
    line = next(ln for ln in message.splitlines() if "CheckpointExistsError: Checkpoint already exists" in ln)
    ids = set(SAVE_ID.findall(line))
    assert outcomes[won[0]] in ids and len(ids) == 2  # names both saves
    assert not staging_dirs(str(target))  # the loser's staging directory is gone
    assert tsckpt.verify(target).ok


def test_two_concurrent_overwriting_saves_publish_in_turn(tmp_path):
    target, outcomes = _race(tmp_path, overwrite=True)
    assert all(isinstance(o, str) for o in outcomes.values()), outcomes
    assert _which(target) in (3, 4)
    assert not staging_dirs(str(target))
    assert tsckpt.verify(target).ok


@pytest.mark.parametrize("overwrite", [False, True])
def test_plain_zarr_group_is_refused_even_when_overwriting(tmp_path, overwrite):
    path = tmp_path / "group"
    group = zarr.open_group(str(path), mode="w")
    group.create_array("data", shape=(4,), dtype="int32")[:] = np.arange(4)
    with pytest.raises(ForeignContentError, match="Zarr group that tsckpt did not write.*with or without overwrite"):
        tsckpt.save(_plain(5), path, overwrite=overwrite)
    np.testing.assert_array_equal(zarr.open_group(str(path), mode="r")["data"][:], np.arange(4))
    assert not staging_dirs(str(path))  # refused before anything was written


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_in_place_of_the_directory_is_refused_even_when_overwriting(tmp_path, overwrite):
    # Files inside the directory are saved beside (tests/test_foreign_content.py, tests/test_save_beside.py).
    path = tmp_path / "target"
    path.write_text("a file")
    with pytest.raises(ForeignContentError, match="is a file, not a checkpoint directory"):
        tsckpt.save(_plain(6), path, overwrite=overwrite)
    with pytest.raises(ForeignContentError):
        tsckpt.CheckpointBuilder(path, overwrite=overwrite)
    assert path.read_text() == "a file"
    assert not staging_dirs(str(path))


def test_empty_directory_is_a_valid_target(tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    tsckpt.save(_plain(7), path)
    assert _which(path) == 7


def test_orphans_of_a_killed_save_are_reported_then_cleaned_by_the_next_save(tmp_path):
    path = tmp_path / "ckpt"
    tsckpt.save(_plain(1), path)
    with pytest.raises(AssertionError):
        dist.run_ranks(2, _save_killed, path, 2, timeout=TIMEOUT)
    assert _which(path) == 1
    [left] = tsckpt.leftovers(path)
    assert left.live is False and left.nbytes > 0 and "staging directory of save" in left.what
    for command in ("info", "verify"):
        res = _cli(command, str(path))
        assert res.exit_code == 0, res.output
        assert "1 leftover(s)" in res.output and f"tsckpt clean {path}" in res.output, res.output
    assert json.loads(_cli("verify", "--json", str(path)).output)["leftovers"][0]["live"] is False
    tsckpt.save(_plain(3), path, overwrite=True)
    assert _which(path) == 3
    assert tsckpt.leftovers(path) == []
    assert "leftover" not in _cli("info", str(path)).output


def test_clean_removes_orphans_and_never_the_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    tsckpt.save(_plain(1), path)
    with pytest.raises(AssertionError):
        dist.run_ranks(2, _save_killed, path, 2, timeout=TIMEOUT)
    res = _cli("clean", str(path))
    assert res.exit_code == 0 and "1 leftover(s) removed" in res.output, res.output
    assert not staging_dirs(str(path)) and _which(path) == 1
    assert "0 leftover(s) removed" in _cli("clean", str(path)).output


def test_a_running_save_is_reported_and_never_cleaned(tmp_path):
    path = tmp_path / "ckpt"
    builder = tsckpt.CheckpointBuilder(path)  # set up, holding its staging directory's lock
    builder.add_tensor("w", torch.ones(3))
    builder.flush()
    assert [i.live for i in tsckpt.leftovers(path)] == [True]
    assert "1 save(s) in progress" in _cli("clean", str(path)).output
    tsckpt.save(_plain(2), tmp_path / "other")  # unrelated targets are not touched either
    builder.commit()
    assert tsckpt.leftovers(path) == []


def test_publication_without_rename_exchange(tmp_path, monkeypatch):
    """The two-rename sequence, used where the filesystem cannot exchange, replaces the checkpoint too."""
    monkeypatch.setattr(StagedTarget, "use_exchange", False)
    path = tmp_path / "ckpt"
    tsckpt.save(_plain(1), path)
    tsckpt.save(_plain(2), path, overwrite=True)
    assert _which(path) == 2 and not staging_dirs(str(path))


def test_publication_interrupted_between_its_two_renames_is_finished(tmp_path):
    """What a save killed between the two renames leaves: old moved aside, new complete beside it."""
    path, new = tmp_path / "ckpt", tmp_path / "new"
    tsckpt.save(_plain(1), path)
    tsckpt.save(_plain(2), new)
    save_id = json.loads((new / "zarr.json").read_text())["attributes"]["tsckpt"]["extra"]["save_id"]
    os.rename(path, staging_path(str(path), save_id, old=True))
    os.rename(new, staging_path(str(path), save_id))
    with pytest.raises(CheckpointNotFoundError, match=f"tsckpt clean {path}"):
        tsckpt.load(_plain(0), path)
    res = _cli("clean", str(path))
    assert res.exit_code == 0, res.output
    assert _which(path) == 2 and not staging_dirs(str(path))


def test_builder_failure_leaves_the_target_as_it_was(tmp_path):
    path = tmp_path / "ckpt"
    tsckpt.save(_plain(1), path)
    with pytest.raises(RuntimeError):
        with tsckpt.CheckpointBuilder(path, overwrite=True) as b:
            b.add_tensor("w", torch.zeros(16, 8))
            raise RuntimeError("conversion failed")
    assert _which(path) == 1 and not staging_dirs(str(path))
    with pytest.raises(CheckpointExistsError, match="Checkpoint already exists"):
        tsckpt.CheckpointBuilder(path)
