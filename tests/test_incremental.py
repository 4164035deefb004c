"""Incremental saves: chunks equal to a base's are taken from it, and every checkpoint still stands alone.

Real files, real spawned gloo ranks, zarr-python reading what tsckpt wrote, and
a real SIGKILL; damage is done to the files on disk (tests/damage.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys

import numpy as np
import pytest
import torch
import zarr

import damage
import dist
import tsckpt
from tsckpt.dcp.planner import SavePlanner
from tsckpt.dcp.storage import TensorStoreWriter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_incremental import allocated, new_bytes  # noqa: E402 - the benchmark's own count of new bytes

TIMEOUT = 240
LAYOUTS = ["plain", "packed"]


def _state(step: int) -> dict:
    """A LoRA-like state: a frozen weight, an adapter that changes every step, a step counter."""
    g = torch.Generator().manual_seed(0)
    frozen = torch.randn(512, 128, generator=g).to(torch.bfloat16)
    adapter = torch.full((8, 4), float(step))
    return {"model": {"frozen": frozen, "adapter": adapter}, "step": step}


def _empty() -> dict:
    return {"model": {"frozen": torch.zeros(512, 128, dtype=torch.bfloat16), "adapter": torch.zeros(8, 4)},
            "step": 0}


def _load(path) -> dict:
    out = _empty()
    tsckpt.load(out, path)
    return out


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(
        torch.equal(a["model"][k].view(torch.uint8), b["model"][k].view(torch.uint8)) for k in a["model"])


def _inode(path, key) -> int:
    return os.stat(os.path.join(path, key)).st_ino


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unchanged_chunks_are_reused_and_the_new_checkpoint_stands_alone(tmp_path, layout, caplog):
    base, new = tmp_path / "step_1", tmp_path / "step_2"
    tsckpt.save(_state(1), base, layout=layout)
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        tsckpt.save(_state(2), new, layout=layout, base=base)
    reuse = tsckpt.open(new).metadata.reuse
    frozen_bytes = 512 * 128 * 2
    assert (reuse.chunks_reused, reuse.bytes_reused, reuse.base) == (1, frozen_bytes, str(base))
    assert reuse.bytes_written == 8 * 4 * 4 and reuse.note is None
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved")]
    assert line.endswith(f"; wrote {reuse.bytes_written} bytes, reused {frozen_bytes} bytes (1 chunks) of {base}")
    if layout == "plain":
        assert _inode(new, "model/frozen/c.0.0") == _inode(base, "model/frozen/c.0.0")
        assert _inode(new, "model/adapter/c.0.0") != _inode(base, "model/adapter/c.0.0")
    # New inodes hold the adapter and the documents, never the frozen weight again.
    assert new_bytes(new, base) < new_bytes(base, None) / 4
    assert _same(_load(new), _state(2)) and _same(_load(base), _state(1))
    shutil.rmtree(base)
    assert _same(_load(new), _state(2))
    assert tsckpt.verify(new).ok


def test_plain_zarr_reads_an_incremental_checkpoint_whose_base_is_gone(tmp_path):
    base, new = tmp_path / "step_1", tmp_path / "step_2"
    tsckpt.save(_state(1), base, layout="plain")
    tsckpt.save(_state(2), new, layout="plain", base=base)
    shutil.rmtree(base)
    root = zarr.open_group(str(new), mode="r")
    frozen = np.asarray(root["model/frozen"][:])
    assert frozen.tobytes() == _state(2)["model"]["frozen"].view(torch.int16).numpy().tobytes()
    assert np.array_equal(root["model/adapter"][:], np.full((8, 4), 2.0, dtype=np.float32))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_damaged_chunk_of_the_base_is_written_again(tmp_path, layout):
    base, new = tmp_path / "step_1", tmp_path / "step_2"
    tsckpt.save(_state(1), base, layout=layout)
    damage.edit_key(base, "model/frozen/c.0.0", lambda b: damage.flip_byte(b, 7))
    assert not tsckpt.verify(base).ok
    tsckpt.save(_state(2), new, layout=layout, base=base)
    assert tsckpt.open(new).metadata.reuse.chunks_reused == 0
    if layout == "plain":
        assert _inode(new, "model/frozen/c.0.0") != _inode(base, "model/frozen/c.0.0")
    assert tsckpt.verify(new).ok and _same(_load(new), _state(2))



def _twins(step: int) -> dict:
    """Two frozen weights of one shape and data type (their chunk files are alike but for the data) and an adapter."""
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(256, 64, generator=g), "b": torch.randn(256, 64, generator=g),
            "adapter": torch.full((4,), float(step))}


#: Damage a faster check of the base's stored bytes must still see, as ``(chunk bytes, the other weight's) -> bytes``.
DAMAGE = {
    "a flipped data byte": lambda b, other: damage.flip_byte(b, 1000),
    "a flipped byte of the shard index": lambda b, other: damage.flip_byte(b, len(b) - 3),
    "a truncated file": lambda b, other: b[:len(b) // 2],
    "the file of the other weight's chunk": lambda b, other: other,
    "an empty file": lambda b, other: b"",
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_base_chunk_damaged_as_stored_is_written_again_and_its_twin_is_reused(tmp_path, layout, kind):
    base, new = tmp_path / "step_1", tmp_path / "step_2"
    tsckpt.save(_twins(1), base, layout=layout)
    assert tsckpt.open(base).metadata.tensors["a"].inner_chunk_shape is not None  # checked as stored
    other = damage.read_key(base, "b/c.0.0")
    damage.edit_key(base, "a/c.0.0", lambda b: DAMAGE[kind](b, other))
    assert not tsckpt.verify(base).ok
    tsckpt.save(_twins(2), new, layout=layout, base=base)
    reuse = tsckpt.open(new).metadata.reuse
    assert (reuse.chunks_reused, reuse.bytes_reused) == (1, 256 * 64 * 4)  # b's chunk only
    if layout == "plain":
        assert _inode(new, "a/c.0.0") != _inode(base, "a/c.0.0") and _inode(new, "b/c.0.0") == _inode(base, "b/c.0.0")
    assert tsckpt.verify(new).ok
    out = {"a": torch.zeros(256, 64), "b": torch.zeros(256, 64), "adapter": torch.zeros(4)}
    tsckpt.load(out, new)
    assert all(torch.equal(out[k], v) for k, v in _twins(2).items())


def test_a_damaged_chunk_without_inner_chunks_is_written_again_and_its_twin_is_linked(tmp_path):
    """Small arrays (no inner chunks: 0-d steps, norms) are checked as stored too before a link takes them."""
    def state(step: int) -> dict:
        return {"count": torch.tensor(7.0), "norm": torch.arange(6.0), "twin": torch.arange(6.0) + 1,
                "adapter": torch.full((3,), float(step))}

    base, new = tmp_path / "step_1", tmp_path / "step_2"
    tsckpt.save(state(1), base, layout="plain")
    assert tsckpt.open(base).metadata.tensors["norm"].inner_chunk_shape is None
    damage.edit_key(base, "norm/c.0", lambda b: damage.flip_byte(b, 2))
    damage.edit_key(base, "count/c", lambda b: b[:2])
    tsckpt.save(state(2), new, layout="plain", base=base)
    assert tsckpt.open(new).metadata.reuse.chunks_reused == 1  # the twin's chunk only
    assert _inode(new, "twin/c.0") == _inode(base, "twin/c.0")
    assert _inode(new, "norm/c.0") != _inode(base, "norm/c.0") and _inode(new, "count/c") != _inode(base, "count/c")
    assert tsckpt.verify(new).ok
    out = {"count": torch.tensor(0.0), "norm": torch.zeros(6), "twin": torch.zeros(6), "adapter": torch.zeros(3)}
    tsckpt.load(out, new)
    assert all(torch.equal(out[k], v) for k, v in state(2).items())


def test_a_base_chunk_whose_crc32c_codec_values_are_damaged_is_written_again(tmp_path):
    """The data still matches the base's checksum table, but Zarr readers, which check the codec, would fail."""
    base, new = tmp_path / "step_1", tmp_path / "step_2"
    tsckpt.save(_twins(1), base, crc32c_codec=True, layout="plain")  # zarr-python reads its files below
    inner = tsckpt.open(base).metadata.tensors["a"].inner_chunk_shape
    piece = 4 * int(np.prod(inner))
    damage.edit_key(base, "a/c.0.0", lambda b: damage.flip_byte(b, piece + 1))  # the codec's crc32c of inner chunk 0
    tsckpt.save(_twins(2), new, base=base, crc32c_codec=True, layout="plain")
    assert tsckpt.open(new).metadata.reuse.chunks_reused == 1  # b's chunk only
    assert np.array_equal(zarr.open_array(str(new / "a"), mode="r")[:], _twins(2)["a"].numpy())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_chain_pruned_to_its_newest_checkpoint_loads(tmp_path, layout):
    for step in (1, 2, 3):
        tsckpt.save(_state(step), tmp_path / f"step_{step}", layout=layout, incremental=True)
    md = tsckpt.open(tmp_path / "step_3").metadata
    assert md.reuse.base == str(tmp_path / "step_2") and md.reuse.chunks_reused == 1
    assert tsckpt.open(tmp_path / "step_1").metadata.reuse is None  # nothing beside it: a full save
    assert tsckpt.prune(tmp_path, keep=1) == [str(tmp_path / "step_1"), str(tmp_path / "step_2")]
    assert sorted(os.listdir(tmp_path)) == ["step_3"]
    assert tsckpt.verify(tmp_path / "step_3").ok and _same(_load(tmp_path / "step_3"), _state(3))


def test_a_base_that_is_not_a_checkpoint_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(tsckpt.TsckptError, match=r"the base of the save to .*step_2 is not a loadable checkpoint"):
        tsckpt.save(_state(2), tmp_path / "step_2", base=tmp_path / "nothing")
    assert sorted(os.listdir(tmp_path)) == ["nothing"]


def test_a_base_in_another_layout_is_compared_but_nothing_is_reused(tmp_path):
    tsckpt.save(_state(1), tmp_path / "step_1", layout="plain")
    tsckpt.save(_state(2), tmp_path / "step_2", layout="packed", base=tmp_path / "step_1")
    reuse = tsckpt.open(tmp_path / "step_2").metadata.reuse
    assert reuse.chunks_reused == 0 and "plain layout" in reuse.note
    assert _same(_load(tmp_path / "step_2"), _state(2))


def test_info_and_ls_report_the_base(tmp_path):
    from cli_run import run_cli
    import json

    tsckpt.save(_state(1), tmp_path / "step_1")
    tsckpt.save(_state(2), tmp_path / "step_2", incremental=True)
    info = run_cli("info", str(tmp_path / "step_2"), env={"COLUMNS": "300"})
    assert info.returncode == 0, info.stderr
    assert f"base" in info.stdout and str(tmp_path / "step_1") in info.stdout
    assert "128 B written, 128.0 KiB reused from the base (1 chunks)" in info.stdout
    listing = json.loads(run_cli("ls", "--json", str(tmp_path / "step_2")).stdout)
    assert listing["reuse"]["bytes_reused"] == 512 * 128 * 2 and listing["reuse"]["base"] == str(tmp_path / "step_1")
    assert json.loads(run_cli("ls", "--json", str(tmp_path / "step_1")).stdout)["reuse"] is None


# --- several ranks ------------------------------------------------------------------------------

def _sharded(step: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    frozen = torch.randn(512, 128, generator=g).to(torch.bfloat16)
    adapter = torch.full((8, 4), float(step))
    return {"model": {"frozen": distribute_tensor(frozen, mesh, [Shard(0)], src_data_rank=None),
                      "adapter": distribute_tensor(adapter, mesh, [Shard(0)], src_data_rank=None)}, "step": step}


def _save_chain(rank, world, root, layout):
    tsckpt.save(_sharded(1, world), os.path.join(root, "step_1"), layout=layout)
    tsckpt.save(_sharded(2, world), os.path.join(root, "step_2"), layout=layout, incremental=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_two_rank_incremental_checkpoint_loads_resharded(tmp_path, layout):
    dist.run_ranks(2, _save_chain, str(tmp_path), layout, timeout=TIMEOUT)
    reuse = tsckpt.open(tmp_path / "step_2").metadata.reuse
    # Both ranks' frozen shards, whichever bands they are stored as.
    assert reuse.chunks_reused >= 2 and reuse.bytes_reused == 512 * 128 * 2
    shutil.rmtree(tmp_path / "step_1")
    # One process, whole tensors: a load in another sharding than the two row shards saved.
    assert _same(_load(tmp_path / "step_2"), _state(2))
    assert tsckpt.verify(tmp_path / "step_2").ok


class _DieAfterWriting(SavePlanner):
    """Rank 1 kills itself once it has resolved all of its data: mid-save, before the commit."""

    def __init__(self):
        super().__init__()
        self.left = None

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if torch.distributed.get_rank() == 1 and write_item.index.fqn == "model.adapter":
            os.kill(os.getpid(), signal.SIGKILL)
        return data


def _incremental_killed(rank, world, root, layout):
    import torch.distributed.checkpoint as dcp

    writer = TensorStoreWriter(os.path.join(root, "step_2"), layout=layout, base=os.path.join(root, "step_1"))
    dcp.save(_sharded(2, world), storage_writer=writer, planner=_DieAfterWriting())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_killed_incremental_save_leaves_its_base_whole(tmp_path, layout):
    dist.run_ranks(2, _save_chain, str(tmp_path), layout, timeout=TIMEOUT)
    shutil.rmtree(tmp_path / "step_2")
    before = allocated(tmp_path / "step_1")
    with pytest.raises(AssertionError):
        dist.run_ranks(2, _incremental_killed, str(tmp_path), layout, timeout=TIMEOUT)
    assert not (tmp_path / "step_2").exists()
    assert allocated(tmp_path / "step_1") == before
    assert tsckpt.verify(tmp_path / "step_1").ok and _same(_load(tmp_path / "step_1"), _state(1))
    assert tsckpt.latest(tmp_path) == str(tmp_path / "step_1")
    assert [left.live for left in tsckpt.leftovers(tmp_path / "step_2")] == [False]
    tsckpt.clean(tmp_path / "step_2")
    assert tsckpt.verify(tmp_path / "step_1").ok


def test_without_a_local_filesystem_nothing_is_reused_and_the_note_says_why():
    tsckpt.save(_state(1), "memory://incremental/step_1")
    tsckpt.save(_state(2), "memory://incremental/step_2", incremental=True)
    reuse = tsckpt.open("memory://incremental/step_2").metadata.reuse
    assert reuse.base == "memory://incremental/step_1" and reuse.chunks_reused == 0
    assert "only checkpoints on a local filesystem share chunks" in reuse.note
    assert reuse.bytes_written == 512 * 128 * 2 + 8 * 4 * 4
    assert _same(_load("memory://incremental/step_2"), _state(2))
