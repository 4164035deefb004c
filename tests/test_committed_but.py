"""A save that failed after its commit point says it is committed and what is left where, not "nothing was committed".

On a local disk a save is committed once its staging directory is renamed
(or exchanged) into place. Two steps follow: the parent directory is
fsynced, and the replaced checkpoint is deleted. When either fails, the save
returns (the checkpoint is live and loads) with a
:class:`~tsckpt.commit.target.PublicationWarning` that names what could not
be done, instead of a SaveFailedError saying nothing was committed.

The replaced checkpoint is made undeletable for real: one of its files is
immutable (``chattr +i``, as root) or its directory is read-only (as any
other user). No filesystem here fails a directory fsync on demand, so that
one is injected into ``os.fsync`` for the parent directory alone.
"""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

import tsckpt
from tsckpt.commit.staging_dirs import staging_dirs
from tsckpt.commit.target import PublicationWarning


def _state(v: float) -> dict:
    return {"w": torch.full((64, 32), float(v)), "step": int(v)}


def _loaded(path) -> int:
    sd = {"w": torch.zeros(64, 32), "step": None}
    tsckpt.load(sd, path)
    assert torch.equal(sd["w"], torch.full((64, 32), float(sd["step"])))
    return sd["step"]


class Undeletable:
    """A checkpoint's first file under ``under`` made undeletable (until :meth:`undo`) by the means this user has."""

    def __init__(self, path: str, under: str):
        top, _, files = next(os.walk(os.path.join(path, under)))
        self.file = os.path.join(top, sorted(files)[0])
        self.root = os.geteuid() == 0
        if self.root:
            done = subprocess.run(["chattr", "+i", self.file], capture_output=True)
            if done.returncode != 0:
                pytest.skip(f"cannot make a file immutable here: {done.stderr.decode().strip()}")
        else:
            os.chmod(top, 0o555)

    def undo(self, moved_to: str) -> None:
        """Make everything deletable again, wherever the checkpoint was moved (``moved_to``)."""
        for top, _, files in os.walk(moved_to):
            if self.root:
                for f in files:
                    subprocess.run(["chattr", "-i", os.path.join(top, f)], capture_output=True)
            else:
                os.chmod(top, 0o755)


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_a_replaced_checkpoint_that_cannot_be_deleted_is_reported_not_a_failed_save(tmp_path, layout):
    path = str(tmp_path / "ck")
    tsckpt.save(_state(1), path, layout=layout)
    stuck = Undeletable(path, "w" if layout == "plain" else "d")  # a chunk file, or the rank's data file
    try:
        with pytest.warns(PublicationWarning) as caught:
            tsckpt.save(_state(2), path, layout=layout, overwrite=True)
        [left] = staging_dirs(path)
        message = str(caught[0].message)
        assert message.startswith(f"{path}: save ") and " is committed, but the checkpoint it replaced is left at " \
            f"{left.path} " in message, message
        assert message.endswith(f"`tsckpt clean {path}` removes it"), message
        assert "\n" not in message
        assert _loaded(path) == 2
    finally:
        for d in staging_dirs(path):
            stuck.undo(d.path)
    assert [d.path for d in tsckpt.clean(path)] == [left.path] and staging_dirs(path) == []
    assert _loaded(path) == 2


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_a_parent_directory_fsync_that_fails_after_the_rename_is_reported_not_a_failed_save(
        tmp_path, monkeypatch, layout):
    parent = str(tmp_path / "run")
    path = os.path.join(parent, "ck")
    tsckpt.save(_state(1), path, layout=layout)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == parent:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.warns(PublicationWarning, match=f"^{path}: save [0-9a-f]{{32}} is committed, but its publication "
                                                f"may not survive a power loss \\(fsync of {parent} failed: "
                                                f"Input/output error\\)$"):
        tsckpt.save(_state(2), path, layout=layout, overwrite=True)
    monkeypatch.undo()
    assert _loaded(path) == 2
    assert staging_dirs(path) == []  # the replaced checkpoint was deleted all the same
