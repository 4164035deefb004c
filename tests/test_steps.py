"""``tsckpt.latest`` / ``tsckpt.prune`` and their commands, on real step directories: local and S3 (moto).

Every entry is real: committed checkpoints from ``tsckpt.save``, dead saves
whose coordinator failed before the commit (chunk files, no ``zarr.json``),
a DCP ``FileSystemWriter`` checkpoint, a plain zarr-python group, a damaged
root document, other tools' files.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import zarr
from typer.testing import CliRunner

import tsckpt
import tsckpt.cli.step_chores  # noqa: F401 - registers latest / prune
from tsckpt import steps
from tsckpt.cli import app
from tsckpt.errors import TsckptError
from tsckpt.storage.context import make_context, open_kvstore
from tsckpt.storage.location import parse_location
from tsckpt.dcp.planner import SavePlanner
from tsckpt.dcp.storage import TensorStoreWriter

BUCKET = "tsckpt-steps"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)


def state(step: int) -> dict:
    return {"model": {"w": torch.full((4, 3), float(step)), "b": torch.arange(3.0)}, "step": step}


class _DiesBeforeCommit(TensorStoreWriter):
    """Every chunk is written, then the job dies before the coordinator commits."""

    def finish(self, metadata, results):
        raise RuntimeError("job killed before the commit")


def dead_save(location, step: int) -> None:
    with pytest.raises(CheckpointException) as info:
        dcp.save(state(step), storage_writer=_DiesBeforeCommit(location), planner=SavePlanner())
    assert "killed before the commit" in str(info.value.failures)
    del info
    gc.collect()  # the dead save's staging lock goes with its writer, as it would with its process
    if isinstance(location, (str, os.PathLike)) and "://" not in str(location):
        # A local save stages beside its target (docs/publication.md), so a dead one leaves
        # the target as it was and its hidden staging directory beside it.
        assert len(staged_dirs(location)) == 1


def staged_dirs(location) -> list[str]:
    parent, name = os.path.split(os.path.abspath(location))
    return [d for d in os.listdir(parent) if d.startswith(f".{name}.tsckpt-")]


def loaded_step(location) -> int:
    back = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "step": None}
    tsckpt.load(back, location)
    assert torch.equal(back["model"]["w"], torch.full((4, 3), float(back["step"])))
    return back["step"]


@pytest.fixture
def root(tmp_path) -> Path:
    """Committed steps 20, 900, 1000 (names sort otherwise as text), a dead save at 500,
    a save still being written at 5000, and entries no tsckpt call may touch."""
    r = tmp_path / "ckpt"
    for s in (20, 900, 1000):
        tsckpt.save(state(s), r / f"step_{s}")
    dead_save(r / "step_500", 500)
    dead_save(r / "step_5000", 5000)
    # Foreign entries, several with larger numbers than any checkpoint.
    dcp.save(state(7000), storage_writer=dcp.FileSystemWriter(str(r / "dcp_7000")))
    zarr.open_group(str(r / "zarr_8000"), mode="w").create_array("x", shape=(2,), dtype="f4")
    (r / "tb_9000").mkdir()
    (r / "tb_9000" / "events.out").write_text("not a checkpoint")
    (r / "empty_9500").mkdir()
    (r / "step_6000").mkdir()
    (r / "step_6000" / "zarr.json").write_text("{ torn")  # damaged: left for a human to look at
    (r / "logs").mkdir()
    (r / "notes_12000.txt").write_text("a file, not a directory")
    os.symlink(r / "step_1000", r / "step_99999")
    return r


def test_scan_classifies_every_entry(root):
    got = [(e.name, e.step, e.state) for e in steps.scan(root)]
    assert got == [
        ("step_20", 20, "committed"), ("step_500", 500, "incomplete"), ("step_900", 900, "committed"),
        ("step_1000", 1000, "committed"), ("step_5000", 5000, "incomplete"), ("step_6000", 6000, "damaged"),
        ("dcp_7000", 7000, "foreign"), ("zarr_8000", 8000, "foreign"), ("tb_9000", 9000, "foreign"),
        ("empty_9500", 9500, "foreign"),
    ]
    # The dead saves really are what a failed save leaves: a staging directory of chunk files, no zarr.json.
    staging = root / staged_dirs(root / "step_500")[0]
    dead = [p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file()]
    assert dead and not [p for p in dead if p.endswith("zarr.json")] and not (root / "step_500").exists()


def test_latest_is_the_highest_committed_step_by_number(root):
    found = tsckpt.latest(root)
    assert found == os.path.join(root, "step_1000")
    assert loaded_step(found) == 1000
    assert tsckpt.latest(str(root)) == f"{root}/step_1000"
    assert tsckpt.latest(f"file://{root}") == f"file://{root}/step_1000"
    spec = tsckpt.latest({"driver": "file", "path": str(root)})
    assert spec == {"driver": "file", "path": f"{root}/step_1000/"} and loaded_step(spec) == 1000


def test_latest_without_checkpoints(tmp_path):
    assert tsckpt.latest(tmp_path / "missing") is None
    (tmp_path / "runs" / "step_5").mkdir(parents=True)  # created, nothing written yet
    assert tsckpt.latest(tmp_path / "runs") is None
    dead_save(tmp_path / "runs" / "step_6", 6)
    assert tsckpt.latest(tmp_path / "runs") is None
    tsckpt.save(state(1), tmp_path / "one")
    with pytest.raises(TsckptError, match="is itself a checkpoint"):
        tsckpt.latest(tmp_path / "one")
    with pytest.raises(TsckptError, match="is a file, not a (checkpoint )?directory"):
        tsckpt.latest(tmp_path / "one" / "zarr.json")


def _names(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()}


def test_prune_keeps_the_newest_and_never_touches_what_it_does_not_own(root):
    before = _names(root)
    assert tsckpt.prune(root, keep=2, dry_run=True) == [os.path.join(root, "step_20")]
    assert _names(root) == before
    assert tsckpt.prune(root, keep=2) == [os.path.join(root, "step_20")]
    assert _names(root) == before - {"step_20"}
    assert tsckpt.prune(root, keep=2) == []
    # keep=1 removes the older committed one; the dead save stays unless asked for.
    assert tsckpt.prune(root, keep=1) == [os.path.join(root, "step_900")]
    assert loaded_step(tsckpt.latest(root)) == 1000
    dead = set(staged_dirs(root / "step_500"))
    assert tsckpt.prune(root, keep=1, remove_incomplete=True) == [os.path.join(root, "step_500")]
    # What is left: the newest checkpoint, the save being written, and every foreign entry untouched.
    assert dead and _names(root) == before - {"step_20", "step_900", *dead}
    assert staged_dirs(root / "step_5000") and (root / "tb_9000" / "events.out").read_text() == "not a checkpoint"
    assert (root / "step_6000" / "zarr.json").read_text() == "{ torn"
    assert os.path.islink(root / "step_99999") and loaded_step(root / "step_99999") == 1000
    assert loaded_step(root / "step_1000") == 1000


def test_prune_never_removes_the_only_committed_checkpoint(tmp_path):
    r = tmp_path / "ckpt"
    tsckpt.save(state(3), r / "step_3")
    dead_save(r / "step_2", 2)
    assert tsckpt.prune(r, keep=1, remove_incomplete=True) == [os.path.join(r, "step_2")]
    assert tsckpt.prune(r, keep=1, remove_incomplete=True) == []
    assert loaded_step(r / "step_3") == 3
    for bad in (0, -1, True, 1.5):
        with pytest.raises(TsckptError, match="keep must be an integer >= 1"):
            tsckpt.prune(r, keep=bad)
    # Without any committed checkpoint nothing is "older than the newest", so nothing goes.
    only_dead = tmp_path / "dead"
    dead_save(only_dead / "step_1", 1)
    assert tsckpt.prune(only_dead, keep=1, remove_incomplete=True) == []


def test_a_prune_that_dies_leaves_a_leftover_prune_recognises(tmp_path, monkeypatch):
    """A prune killed while deleting leaves its checkpoint renamed aside, never a loadable husk nor foreign data."""
    r = tmp_path / "ckpt"
    for s in (1, 2):
        tsckpt.save(state(s), r / f"step_{s}")

    def dies(path, *args, **kwargs):  # the process is killed while deleting the data files
        raise OSError("killed")

    monkeypatch.setattr(steps, "remove_tree", dies)
    with pytest.raises(TsckptError, match="removing .*step_1 failed: killed"):
        tsckpt.prune(r, keep=1)
    assert not (r / "step_1").exists()
    aside = staged_dirs(r / "step_1")
    assert len(aside) == 1 and aside[0].endswith(".old") and any((r / aside[0]).iterdir())  # the data stays
    assert [(e.name, e.state) for e in steps.scan(r)] == [("step_1", "incomplete"), ("step_2", "committed")]
    monkeypatch.undo()
    assert tsckpt.prune(r, keep=1, remove_incomplete=True) == [os.path.join(r, "step_1")]
    assert not staged_dirs(r / "step_1") and _names(r) == {"step_2"}


def test_cli_latest_and_prune(root):
    runner = CliRunner()
    res = runner.invoke(app, ["latest", str(root)])
    assert res.exit_code == 0 and res.stdout.strip() == os.path.join(root, "step_1000")
    res = runner.invoke(app, ["latest", str(root), "--json"])
    doc = json.loads(res.stdout)
    assert doc["latest"] == os.path.join(root, "step_1000")
    assert {e["name"]: e["state"] for e in doc["entries"]}["step_500"] == "incomplete"
    res = runner.invoke(app, ["prune", str(root), "--keep", "1", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == [f"would remove {root}/step_20", f"would remove {root}/step_900"]
    assert (root / "step_20").is_dir()
    res = runner.invoke(app, ["prune", str(root), "-k", "1", "--remove-incomplete"])
    assert res.stdout.splitlines() == [f"removed {root}/{n}" for n in ("step_20", "step_500", "step_900")]
    assert runner.invoke(app, ["prune", str(root), "-k", "1"]).stdout.strip() == "nothing to remove"
    assert runner.invoke(app, ["prune", str(root), "--keep", "0"]).exit_code == 2
    empty = root / "logs"
    res = runner.invoke(app, ["latest", str(empty)])
    assert res.exit_code == 1 and res.stdout == "" and "no committed checkpoint under" in res.stderr


# --- object storage ------------------------------------------------------------------------------

def keys_under(s3, prefix: str) -> set[str]:
    return set(s3.keys(BUCKET, prefix))


def put(s3, key: str, data: bytes) -> None:
    kv = open_kvstore(parse_location(s3.location(BUCKET, "")), make_context())
    kv.write(key, data).result()


def test_latest_and_prune_on_s3(s3, monkeypatch):
    run = "steps/run-a"
    for s in (90, 100, 1000):
        tsckpt.save(state(s), s3.location(BUCKET, f"{run}/step_{s}"))
    dead_save(s3.location(BUCKET, f"{run}/step_95"), 95)
    dead_save(s3.location(BUCKET, f"{run}/step_2000"), 2000)  # being written
    put(s3, f"{run}/events_5000/log.txt", b"other tool")
    put(s3, f"{run}/step_3000/", b"")  # a folder marker some S3 tools create
    put(s3, f"{run}/notes_9000", b"a file at the root")
    root = s3.location(BUCKET, run)

    assert [(e.name, e.state) for e in steps.scan(root)] == [
        ("step_90", "committed"), ("step_95", "incomplete"), ("step_100", "committed"),
        ("step_1000", "committed"), ("step_2000", "incomplete"), ("step_3000", "foreign"),
        ("events_5000", "foreign")]
    found = tsckpt.latest(root)
    assert found == {**root, "url": f"s3://{BUCKET}/{run}/step_1000"}
    assert loaded_step(found) == 1000

    before = keys_under(s3, f"{run}/")
    assert tsckpt.prune(root, keep=2, dry_run=True) == [f"s3://{BUCKET}/{run}/step_90"]
    assert keys_under(s3, f"{run}/") == before
    assert tsckpt.prune(root, keep=2, remove_incomplete=True) == [
        f"s3://{BUCKET}/{run}/step_90", f"s3://{BUCKET}/{run}/step_95"]
    after = keys_under(s3, f"{run}/")
    gone = {k for k in before if k.startswith((f"{run}/step_90/", f"{run}/step_95/"))}
    assert gone and after == before - gone
    assert loaded_step(s3.location(BUCKET, f"{run}/step_100")) == 100

    # The command line reaches the same server through the usual AWS variables.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    res = CliRunner().invoke(app, ["latest", f"s3://{BUCKET}/{run}"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == f"s3://{BUCKET}/{run}/step_1000"
    res = CliRunner().invoke(app, ["prune", f"s3://{BUCKET}/{run}", "--keep", "1"])
    assert res.stdout.splitlines() == [f"removed s3://{BUCKET}/{run}/step_100"]
    assert np.array_equal(tsckpt.open(f"s3://{BUCKET}/{run}/step_1000")["model.w"].numpy(), np.full((4, 3), 1000.0))
