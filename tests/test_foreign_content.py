"""A save never touches what tsckpt did not write: it writes beside it, as DCP's own writer does.

A run directory (or bucket prefix) holding a config, logs and a directory that
looks like a step checkpoint is where a training script saves, with
``dcp.save`` as with ``FileSystemWriter``. Every call that writes or removes
checkpoints (``dcp.save`` with the writer's defaults, ``tsckpt.save``,
``convert``, ``clean``, ``prune``) must leave those files byte for byte and
write its own beside them; a save that fails, or is killed while it
publishes, leaves them too, and never the previous checkpoint damaged.
Another tool's Zarr data is refused (tests/test_foreign_zarr.py).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tsckpt
import tsckpt.commit.states
from tsckpt import TensorStoreWriter
from tsckpt.commit.protocol import leftovers
from tsckpt.errors import CheckpointExistsError, ForeignContentError
from tsckpt.storage.context import make_context, open_kvstore
from tsckpt.storage.location import parse_location

FOREIGN = {
    "config.yaml": b"lr: 0.1\n",
    "logs/events.txt": b"step 100 loss 2.5\n",
    "step_100/notes.md": b"# notes of a step that tsckpt never saved\n",
}


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("this value cannot be pickled")


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

    def keys(self) -> list[str]:
        """Every file under the run directory, and every entry beside it (staging directories)."""
        inside = [str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()]
        return sorted(inside) + sorted(n for n in os.listdir(self.root.parent) if n != self.root.name)

    def others(self) -> list[str]:
        return sorted(k for k in self.keys() if not tsckpt.commit.states.is_zarr_key(k))


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

    def keys(self) -> list[str]:
        return sorted(k.decode() for k in self.kv.list().result())

    def others(self) -> list[str]:
        return sorted(k for k in self.keys() if not tsckpt.commit.states.is_zarr_key(k))


BUCKET = "tsckpt-foreign"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)
ROOT_BUCKET = "tsckpt-foreign-root"
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


def _dcp_save(state: dict, location, **options) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=TensorStoreWriter(location, **options), no_dist=True)


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_dcp_save_with_the_writers_defaults_writes_beside_the_run_directorys_files(run_dir, layout):
    """The drop-in call into a run directory, as with FileSystemWriter; again, replacing its checkpoint."""
    for step in (1, 2):
        _dcp_save(_state(step), run_dir.location(), layout=layout)
        assert _loaded(run_dir.location()) == step
        _intact(run_dir)
    assert leftovers(run_dir.location()) == []  # no staging directory, no claim, no replaced tree
    assert run_dir.others() == sorted(FOREIGN)


@pytest.mark.parametrize("overwrite", [False, True])
def test_tsckpt_save_into_a_run_directory_writes_beside_its_files(run_dir, overwrite):
    tsckpt.save(_state(1), run_dir.location(), overwrite=overwrite)
    assert _loaded(run_dir.location()) == 1
    with pytest.raises(CheckpointExistsError):
        tsckpt.save(_state(2), run_dir.location())
    tsckpt.save(_state(3), run_dir.location(), overwrite=True)
    assert _loaded(run_dir.location()) == 3
    _intact(run_dir)
    # A step directory beside them, the layout of a training loop, keeps them all too.
    tsckpt.save(_state(4), run_dir.location("step_200"), overwrite=overwrite)
    assert _loaded(run_dir.location("step_200")) == 4 and _loaded(run_dir.location()) == 3
    _intact(run_dir)


def test_a_step_like_directory_with_a_file_of_its_own_is_saved_into_beside_it(run_dir):
    tsckpt.save(_state(1), run_dir.location("step_100"), overwrite=True)
    assert _loaded(run_dir.location("step_100")) == 1
    _intact(run_dir)


def test_overwriting_a_checkpoint_keeps_a_file_put_beside_it(run_dir):
    tsckpt.save(_state(1), run_dir.location("step_300"))
    run_dir.put("step_300/README.md", b"what this checkpoint is\n")
    tsckpt.save(_state(2), run_dir.location("step_300"), overwrite=True)
    assert run_dir.get("step_300/README.md") == b"what this checkpoint is\n"
    assert _loaded(run_dir.location("step_300")) == 2
    assert leftovers(run_dir.location("step_300")) == []
    _intact(run_dir)


def test_a_failed_save_into_a_run_directory_removes_what_it_staged(run_dir):
    tsckpt.save(_state(1), run_dir.location())
    before = run_dir.keys()
    with pytest.raises(tsckpt.SaveFailedError, match="(?s)cannot be pickled.*what the save had written was removed"):
        tsckpt.save({**_state(2), "z": Unpicklable()}, run_dir.location(), overwrite=True)
    if isinstance(run_dir, Local):
        assert run_dir.keys() == before and _loaded(run_dir.location()) == 1
    else:  # written in place: the overwrite had un-committed the old checkpoint (docs/publication.md)
        assert run_dir.keys() == sorted(FOREIGN)
    assert leftovers(run_dir.location()) == []
    _intact(run_dir)


def test_another_tools_zarr_array_in_a_run_directory_is_refused(run_dir):
    run_dir.put("embeddings/zarr.json", b'{"zarr_format": 3, "node_type": "array"}')
    run_dir.put("embeddings/c/0", b"\0" * 8)
    for overwrite in (False, True):
        with pytest.raises(ForeignContentError, match="Zarr data tsckpt did not write.*'embeddings/zarr.json'"):
            tsckpt.save(_state(1), run_dir.location(), overwrite=overwrite)
    assert run_dir.get("embeddings/c/0") == b"\0" * 8
    assert run_dir.get("zarr.json") is None
    _intact(run_dir)


def test_convert_writes_into_a_run_directory_beside_its_files(run_dir, tmp_path):
    src = tmp_path / "src.safetensors"
    tsckpt.convert(_save_tmp(tmp_path), str(src), to="safetensors")
    tsckpt.convert(str(src), run_dir.location(), to="tsckpt", overwrite=True)
    sd = {"w": torch.zeros(4, 3)}
    tsckpt.load(sd, run_dir.location())
    assert torch.equal(sd["w"], torch.full((4, 3), 4.0))
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


def test_a_save_into_a_bucket_root_keeps_its_other_objects(s3):
    """``TensorStoreWriter("s3://bucket")`` with the defaults: the bucket's other objects stay as they are."""
    s3.create_bucket(ROOT_BUCKET)  # a bucket of its own: the module's holds other tests' checkpoints
    store = S3Prefix(s3, "")
    store.kv = open_kvstore(parse_location(s3.location(ROOT_BUCKET, "")), make_context())
    store.put("datasets/shard-0000.tar", b"data")
    for step in (1, 2):
        _dcp_save(_state(step), s3.location(ROOT_BUCKET, ""))
        assert _loaded(s3.location(ROOT_BUCKET, "")) == step
    assert store.get("datasets/shard-0000.tar") == b"data"
    assert os.environ.get("AWS_ACCESS_KEY_ID")  # the fixture's credentials were in force
