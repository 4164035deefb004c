"""Damaged chunks are detected on load and by ``tsckpt verify``, naming tensor and chunk."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import tsckpt
from damage import edit_key, flip_byte, layout_of, read_key, write_key
from tsckpt.errors import TsckptError
from tsckpt.commit import protocol as commit
from tsckpt.read.verify import verify


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(16, 8, generator=g), "zeros": torch.zeros(6, 5)},
            "step": torch.tensor(3, dtype=torch.int64), "extra": {"tags": {"a", "b"}}}


def _empty() -> dict:
    return {"model": {"w": torch.zeros(16, 8), "zeros": torch.ones(6, 5)},
            "step": torch.tensor(0, dtype=torch.int64), "extra": {"tags": None}}


@pytest.fixture(params=["plain", "packed"])
def ckpt(tmp_path, request):
    """A checkpoint whose ``model/w`` uses the sharding codec (inner chunks of 4x8), in each layout."""
    path = tmp_path / "ckpt"
    # Zarr's crc32c codec as well: these tests damage encoded shards and their indexes.
    tsckpt.save(_state(), path, inner_chunk_bytes=128, crc32c_codec=True, layout=request.param)
    return path


def _flip(ckpt, key: str, offset: int = 3) -> None:
    edit_key(ckpt, key, lambda data: flip_byte(data, offset, 0x10))


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from tsckpt.cli import main; sys.argv = ['tsckpt', *sys.argv[1:]]; main()"
    # Wide enough that no problem line is wrapped (packed ones name the database).
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})


def test_clean_checkpoint_loads_and_verifies(ckpt):
    sd = _empty()
    tsckpt.load(sd, ckpt, allow_pickle=False)
    assert torch.equal(sd["model"]["w"], _state()["model"]["w"])
    assert torch.equal(sd["model"]["zeros"], torch.zeros(6, 5))
    report = verify(ckpt)
    assert report.ok, report.to_dict()
    assert {e.key for e in report.entries} == {"model.w", "model.zeros", "step", "extra.tags"}
    result = _cli("verify", str(ckpt))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_all_zero_tensor_is_stored_not_left_to_fill_value(ckpt):
    # Without store_data_equal_to_fill_value TensorStore writes no file for an all-zero chunk.
    assert read_key(ckpt, "model/zeros/c.0.0")


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_chunk_is_refused_on_load(ckpt, damage):
    chunk = "model/zeros/c.0.0"
    if damage == "flip":
        _flip(ckpt, chunk)
    elif damage == "truncate":
        edit_key(ckpt, chunk, lambda data: data[:7])
    else:
        write_key(ckpt, chunk, None)
    with pytest.raises(TsckptError) as info:
        tsckpt.load(_empty(), ckpt)
    message = str(info.value)
    assert "'model.zeros'" in message and "c.0.0" in message, message
    report = verify(ckpt)
    assert not report.ok
    (bad,) = report.failed
    assert bad.key == "model.zeros" and any("c.0.0" in p for p in bad.problems), bad.problems
    assert len(bad.problems) == 1, bad.problems  # a missing chunk is reported once, not again as a failed read


def test_flipped_inner_chunk_of_a_shard_is_detected(ckpt):
    _flip(ckpt, "model/w/c.0.0", offset=200)  # inside the data of an inner chunk, not the index at the end
    with pytest.raises(TsckptError, match=r"'model\.w'.*chunk \[0, 0\] does not match its stored crc32c at inner chunk"):
        tsckpt.load(_empty(), ckpt)
    report = verify(ckpt)
    assert [e.key for e in report.failed] == ["model.w"]
    assert "does not match its stored crc32c" in report.failed[0].problems[0]


def test_flipped_shard_index_is_detected(ckpt):
    shard = "model/w/c.0.0"
    _flip(ckpt, shard, offset=len(read_key(ckpt, shard)) - 6)
    with pytest.raises(TsckptError, match=r"'model\.w'"):
        tsckpt.load(_empty(), ckpt)
    assert [e.key for e in verify(ckpt).failed] == ["model.w"]


def test_damaged_value_blob_is_detected(ckpt):
    _flip(ckpt, "extra/tags/c.0")
    report = verify(ckpt)
    assert [e.key for e in report.failed] == ["extra.tags"]


def test_cli_reports_each_damaged_tensor_and_exits_nonzero(ckpt):
    _flip(ckpt, "model/zeros/c.0.0")
    write_key(ckpt, "step/c", None)
    result = _cli("verify", str(ckpt), "--no-progress")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "model.zeros" in result.stdout and "step" in result.stdout and "FAILED" in result.stdout
    assert "missing" in result.stdout and "does not match its stored crc32c" in result.stdout, result.stdout
    as_json = json.loads(_cli("verify", str(ckpt), "--json").stdout)
    assert {e["key"] for e in as_json["entries"] if e["problems"]} == {"model.zeros", "step"}


def test_verify_catches_zarr_json_that_disagrees_with_metadata(ckpt):
    doc = json.loads(read_key(ckpt, "model/w/zarr.json"))
    doc["shape"] = [8, 8]
    write_key(ckpt, "model/w/zarr.json", json.dumps(doc).encode())
    report = verify(ckpt)
    assert [e.key for e in report.failed] == ["model.w"]
    assert "disagrees" in report.failed[0].problems[0]
    # Loads open arrays from the root document alone: a damaged zarr.json cannot mislead them.
    sd = _empty()
    tsckpt.load(sd, ckpt)
    assert torch.equal(sd["model"]["w"], _state()["model"]["w"])


def test_verify_catches_missing_array_a_wrong_checksum_and_a_swapped_chunk(ckpt):
    write_key(ckpt, "model/zeros/zarr.json", None)
    # model/w is two 8x8 outer chunks of 4x8 inner chunks: 128 bytes of data, then their crc32c.
    edit_key(ckpt, "model/w/c.0.0", lambda data: flip_byte(data, 128))  # the stored crc32c, not the data
    report = verify(ckpt)
    failed = {e.key: e.problems for e in report.failed}
    assert set(failed) == {"model.zeros", "model.w"}
    assert "missing" in failed["model.zeros"][0]
    assert "chunk [0, 0] does not match its stored crc32c" in failed["model.w"][0]
    result = _cli("verify", str(ckpt))
    assert result.returncode == 1


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_verify_catches_a_chunk_replaced_by_another_intact_one(tmp_path, layout):
    """Every crc32c of the copy is right; the content hash its rank recorded for the chunk is not."""
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "twins"
    tsckpt.save({"a": torch.randn(16, 8, generator=g), "b": torch.randn(16, 8, generator=g)}, path, layout=layout)
    write_key(path, "a/c.0.0", read_key(path, "b/c.0.0"))
    report = verify(path)
    assert [e.key for e in report.failed] == ["a"]
    assert "content hash" in report.failed[0].problems[0]


def test_cli_refuses_incomplete_checkpoint(ckpt):
    (ckpt / "zarr.json").unlink()
    result = _cli("verify", str(ckpt))
    assert result.returncode == 2
    assert "incomplete" in result.stderr



def _save_many_chunks(rank, world, path):
    """A 64-row tensor saved as a ShardedTensor of 64 one-row shards: 64 outer chunks."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rows = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    shards = [Shard(rows[i:i + 1].clone(), ShardMetadata([i, 0], [1, 16], f"rank:{rank}/cpu")) for i in range(64)]
    tsckpt.save({"emb": init_from_local_shards(shards, 64, 16), "b": torch.ones(3)}, path)


def test_verify_reads_each_chunk_table_once(tmp_path, monkeypatch):
    # Reading the ranks' tables for every chunk would cost chunks x ranks reads. Count the bytes taken, not the time.
    import dist
    from tsckpt.format.chunk_table import TableReader

    dist.run_ranks(1, _save_many_chunks, str(tmp_path / "ck"))
    md = commit.open_committed(tmp_path / "ck")[1]
    assert md.tensors["emb"].grid.nchunks == 64
    taken: dict[str, int] = {}
    real = TableReader.take

    def take(self, spans, data):
        taken[self.where] = taken.get(self.where, 0) + sum(n for _, n in spans)
        return real(self, spans, data)

    monkeypatch.setattr(TableReader, "take", take)
    report = verify(tmp_path / "ck")
    assert report.ok and report.checksummed == 65
    table = md.data_files.ranks[0].table
    assert list(taken.values()) == [table.length], taken  # one table, each byte read once
