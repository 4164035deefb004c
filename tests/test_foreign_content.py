"""A save never deletes what tsckpt did not write: not with DCP's defaults, not with overwrite, not on S3.

A run directory (or bucket prefix) holding a config, logs and a directory that
looks like a step checkpoint is the usual place a user points a writer at by
mistake. Every call that writes or removes checkpoints (``dcp.save`` with the
writer's defaults, ``tsckpt.save``, ``convert``, ``clean``, ``prune``) must
leave those files byte for byte, and either write beside them or refuse in one
line that says why.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tsckpt
from tsckpt import TensorStoreWriter
from tsckpt.errors import ForeignContentError
from tsckpt.storage.context import make_context, open_kvstore
from tsckpt.storage.location import parse_location

FOREIGN = {
    "config.yaml": b"lr: 0.1\n",
    "logs/events.txt": b"step 100 loss 2.5\n",
    "step_100/notes.md": b"# notes of a step that tsckpt never saved\n",
}


def _state(v: float) -> dict:
    return {"w": torch.full((4, 3), float(v)), "step": int(v)}


def _loaded(location) -> int:
    sd = _state(0)
    tsckpt.load(sd, location)
    return sd["step"]


class Local:
    def __init__(self, root):
        self.root = root

    def location(self, rel: str = ""):
        return str(self.root / rel) if rel else str(self.root)

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def get(self, key: str) -> bytes | None:
        path = self.root / key
        return path.read_bytes() if path.is_file() else None


class S3Prefix:
    def __init__(self, server, prefix: str):
        self.server, self.prefix = server, prefix
        loc = parse_location(server.location(BUCKET, prefix))
        self.kv = open_kvstore(loc, make_context(location=loc))

    def location(self, rel: str = ""):
        return self.server.location(BUCKET, f"{self.prefix}/{rel}" if rel else self.prefix)

    def put(self, key: str, data: bytes) -> None:
        self.kv.write(key, data).result()

    def get(self, key: str) -> bytes | None:
        result = self.kv.read(key).result()
        return result.value if result.state == "value" else None


BUCKET = "tsckpt-foreign"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)
_RUNS = iter(range(10**6))


@pytest.fixture(params=["local", "s3"])
def run_dir(request, tmp_path):
    """A run directory (or S3 prefix) holding a config, logs and a step-like directory tsckpt did not write."""
    if request.param == "local":
        store = Local(tmp_path / "run")
    else:
        store = S3Prefix(request.getfixturevalue("s3"), f"foreign/run{next(_RUNS)}")
    for key, data in FOREIGN.items():
        store.put(key, data)
    return store


def _intact(store) -> None:
    for key, data in FOREIGN.items():
        assert store.get(key) == data, f"{key} was changed or deleted"


def test_dcp_save_with_the_writers_defaults_keeps_everything(run_dir):
    """The drop-in call that used to delete the run directory (overwrite defaults to True, as DCP's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException) as raised:  # DCP's CheckpointException is a BaseException
            dcp.save({"w": torch.ones(4)}, storage_writer=TensorStoreWriter(run_dir.location()), no_dist=True)
    # DCP wraps what a rank raised; the rank's own error is what says why.
    failures = getattr(raised.value, "failures", None)
    cause = failures[0][0] if failures else raised.value
    assert isinstance(cause, ForeignContentError), repr(raised.value)
    assert "3 file(s) tsckpt did not write" in str(cause) and "with or without overwrite" in str(cause)
    _intact(run_dir)


@pytest.mark.parametrize("overwrite", [False, True])
def test_tsckpt_save_into_a_run_directory_refuses_and_saves_beside(run_dir, overwrite):
    with pytest.raises(ForeignContentError, match="e.g. 'config.yaml'.*such as a subdirectory"):
        tsckpt.save(_state(1), run_dir.location(), overwrite=overwrite)
    _intact(run_dir)
    # A step directory beside the foreign files is the intended use: it keeps them all.
    tsckpt.save(_state(2), run_dir.location("step_200"), overwrite=overwrite)
    tsckpt.save(_state(3), run_dir.location("step_200"), overwrite=True)
    assert _loaded(run_dir.location("step_200")) == 3
    _intact(run_dir)


def test_a_step_like_directory_with_foreign_files_is_never_replaced(run_dir):
    with pytest.raises(ForeignContentError, match="notes.md"):
        tsckpt.save(_state(1), run_dir.location("step_100"), overwrite=True)
    _intact(run_dir)


def test_overwriting_a_checkpoint_that_holds_a_foreign_file_refuses(run_dir):
    tsckpt.save(_state(1), run_dir.location("step_300"))
    run_dir.put("step_300/README.md", b"what this checkpoint is\n")
    with pytest.raises(ForeignContentError, match="README.md"):
        tsckpt.save(_state(2), run_dir.location("step_300"), overwrite=True)
    assert run_dir.get("step_300/README.md") == b"what this checkpoint is\n"
    assert _loaded(run_dir.location("step_300")) == 1
    _intact(run_dir)


def test_convert_refuses_a_run_directory(run_dir, tmp_path):
    src = tmp_path / "src.safetensors"
    tsckpt.convert(_save_tmp(tmp_path), str(src), to="safetensors")
    with pytest.raises(ForeignContentError):
        tsckpt.convert(str(src), run_dir.location(), to="tsckpt", overwrite=True)
    _intact(run_dir)


def _save_tmp(tmp_path) -> str:
    path = str(tmp_path / "plain")
    tsckpt.save(_state(4), path)
    return path


def test_clean_and_prune_delete_only_what_tsckpt_wrote(run_dir):
    for step in (1, 2, 3):
        tsckpt.save(_state(step), run_dir.location(f"step_{step}"))
    run_dir.put("step_1/README.md", b"kept\n")  # a note beside an old checkpoint
    tsckpt.clean(run_dir.location(), force=True)
    _intact(run_dir)
    removed = tsckpt.prune(run_dir.location(), keep=1)
    assert len(removed) == 2
    _intact(run_dir)
    assert run_dir.get("step_1/README.md") == b"kept\n"
    assert run_dir.get("step_1/zarr.json") is None and run_dir.get("step_2/zarr.json") is None
    assert _loaded(run_dir.location("step_3")) == 3


def test_a_bucket_root_is_never_emptied(s3):
    """``TensorStoreWriter("s3://bucket")`` with the defaults: the bucket's other objects survive."""
    store = S3Prefix(s3, "")
    store.kv = open_kvstore(parse_location(s3.location(BUCKET, "")), make_context())
    store.put("datasets/shard-0000.tar", b"data")
    with pytest.raises(ForeignContentError, match="did not write"):
        tsckpt.save(_state(1), s3.location(BUCKET, ""), overwrite=True)
    assert store.get("datasets/shard-0000.tar") == b"data"
    assert os.environ.get("AWS_ACCESS_KEY_ID")  # the fixture's credentials were in force
