"""Zarr data someone else wrote is never tsckpt's to delete.

A directory of arrays written by zarr-python, with no root group document,
holds only names a tsckpt save also writes (``zarr.json``, ``c/0/0``, ``c.0``).
tsckpt must still tell it from a dead save's leftovers: without a committed
root document, keys are tsckpt's only under a save's claim (object stores) or
in a save's own staging directory (local disks). Every call that writes or
removes checkpoints is tried on such a directory, on a local disk and on S3,
in both layouts; each must refuse (or skip it) and leave every file as it was.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr

import tsckpt
from tsckpt import TensorStoreWriter
from tsckpt.errors import ForeignContentError
from tsckpt.storage.context import make_context, open_kvstore
from tsckpt.storage.location import parse_location
from tsckpt.steps import scan

BUCKET = "tsckpt-foreign-zarr"  # this module's bucket on the run's moto server (conftest.py)
_RUNS = iter(range(10**6))


def zarr_files(tmp: Path) -> dict[str, bytes]:
    """Two arrays written by zarr-python side by side, no root group: every file, by key."""
    root = tmp / "written-by-zarr"
    emb = zarr.open_array(str(root / "embeddings"), mode="w", shape=(8, 4), chunks=(4, 4), dtype="float32")
    emb[:] = np.arange(32, dtype="float32").reshape(8, 4)
    ids = zarr.open_array(str(root / "ids"), mode="w", shape=(6,), chunks=(3,), dtype="int64")
    ids[:] = np.arange(6)
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    assert "zarr.json" not in files and len(files) == 6, sorted(files)
    return files


class Local:
    def __init__(self, root: Path):
        self.root = root

    def location(self, rel: str = "") -> str:
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

    def location(self, rel: str = "") -> str:
        return self.server.location(BUCKET, f"{self.prefix}/{rel}" if rel else self.prefix)

    def put(self, key: str, data: bytes) -> None:
        self.kv.write(key, data).result()

    def get(self, key: str) -> bytes | None:
        result = self.kv.read(key).result()
        return result.value if result.state == "value" else None


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return Local(tmp_path / "data")
    return S3Prefix(request.getfixturevalue("s3"), f"zarr{next(_RUNS)}")


@pytest.fixture
def arrays(tmp_path):
    return zarr_files(tmp_path)


def put_all(store, arrays: dict[str, bytes], under: str = "") -> None:
    for key, data in arrays.items():
        store.put(f"{under}{key}", data)


def intact(store, arrays: dict[str, bytes], under: str = "") -> None:
    for key, data in arrays.items():
        assert store.get(f"{under}{key}") == data, f"{under}{key} was changed or deleted"


def _state(v: float) -> dict:
    return {"w": torch.full((4, 3), float(v)), "step": int(v)}


LAYOUTS = ["plain", "packed"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("overwrite", [False, True])
def test_save_refuses_a_directory_of_zarr_arrays(store, arrays, layout, overwrite):
    put_all(store, arrays)
    with pytest.raises(ForeignContentError, match="Zarr data tsckpt did not write") as raised:
        tsckpt.save(_state(1), store.location(), overwrite=overwrite, layout=layout)
    assert "\n" not in str(raised.value)
    intact(store, arrays)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dcp_save_at_the_writers_defaults_refuses(store, arrays, layout):
    put_all(store, arrays)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException) as raised:  # DCP's CheckpointException is a BaseException
            dcp.save({"w": torch.ones(4)}, storage_writer=TensorStoreWriter(store.location(), layout=layout),
                     no_dist=True)
    failures = getattr(raised.value, "failures", None)
    cause = failures[0][0] if failures else raised.value
    assert isinstance(cause, ForeignContentError), repr(raised.value)
    intact(store, arrays)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_convert_refuses(store, arrays, layout, tmp_path):
    src = str(tmp_path / "src")
    tsckpt.save(_state(4), src)
    put_all(store, arrays)
    with pytest.raises(ForeignContentError):
        tsckpt.convert(src, store.location(), to="tsckpt", overwrite=True, layout=layout)
    intact(store, arrays)


def test_clean_leaves_it(store, arrays):
    put_all(store, arrays)
    assert tsckpt.clean(store.location(), force=True) == []
    intact(store, arrays)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prune_skips_a_step_directory_of_zarr_arrays(store, arrays, layout):
    put_all(store, arrays, "step_1/")
    for step in (2, 3, 4):
        tsckpt.save(_state(step), store.location(f"step_{step}"), layout=layout)
    removed = tsckpt.prune(store.location(), keep=1, remove_incomplete=True)
    assert [r.rstrip("/").rsplit("/", 1)[-1] for r in removed] == ["step_2", "step_3"]
    intact(store, arrays, "step_1/")
    states = {e.name: e.state for e in scan(store.location())}
    assert states == {"step_1": "foreign", "step_4": "committed"}
    assert "step_4" in str(tsckpt.latest(store.location()))


def test_a_checkpoint_with_a_zarr_array_added_inside_is_not_replaced(store, arrays):
    tsckpt.save(_state(1), store.location("ckpt"))
    put_all(store, {k: v for k, v in arrays.items() if k.startswith("ids/")}, "ckpt/extra/")
    with pytest.raises(ForeignContentError):
        tsckpt.save(_state(2), store.location("ckpt"), overwrite=True)
    intact(store, {k: v for k, v in arrays.items() if k.startswith("ids/")}, "ckpt/extra/")
    sd = _state(0)
    tsckpt.load(sd, store.location("ckpt"))
    assert sd["step"] == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prune_deletes_a_checkpoint_but_not_an_array_added_inside_it(store, arrays, layout):
    added = {k: v for k, v in arrays.items() if k.startswith("embeddings/")}
    for step in (1, 2):
        tsckpt.save(_state(step), store.location(f"step_{step}"), layout=layout)
    put_all(store, added, "step_1/extra/")
    assert len(tsckpt.prune(store.location(), keep=1)) == 1
    intact(store, added, "step_1/extra/")
    assert store.get("step_1/zarr.json") is None
    assert {e.name: e.state for e in scan(store.location())} == {"step_1": "foreign", "step_2": "committed"}
